"""Delta coding of activations against what was sent for the same sample last time (AQ-SGD).

A device that trains on a sample again (a new epoch over its partition, or a sampler that
draws a block twice) sends, for that row of an ``ACTIVATION``, the difference between the
head's output now and the value the server decoded for the same sample last time. The head
changes slowly, so the difference is small and its quantisation error is small: at the same
bits per value the server sees the activation more precisely (Wang et al., "Fine-tuning
language models over slow networks using activation compression with guarantees", 2022).

- **Sample key.** One per row: a 63-bit BLAKE2b hash of the row's token ids, keyed with a
  random salt that never leaves the device. Both sides agree on it because the device sends
  it (``StageMessage.sample_keys``); the server learns only that two rows hold the same
  sample, never the tokens, and a key from one session means nothing in another.
- **Mirrored caches.** Sender and receiver each keep a :class:`DeltaCache` of the last
  decoded value per key, with the same byte cap, and apply the same puts in the same order
  (a session's stream delivers its messages in order), so they evict the same rows and hold
  the same bases. A row is sent as a difference (its key's bit 63 set) only if the sender
  holds a base for its key with the row's shape; otherwise it is sent whole. The receiver
  refuses a difference whose base it lacks (``TensorFormatError``), so a broken mirror is
  loud, never silent.
- **Identical reconstruction.** Both sides rebuild the row as ``decoded + base`` with the same
  code on the same bytes (the sender decodes its own message, see ``decode_wire``), so the
  caches stay bit-identical and quantisation errors do not pile up from one epoch to the
  next: each send corrects the base by the new difference.
- **Lifetime.** A device may keep its encoder (cache and salt) across sessions, so that it
  gains when it sees its data again in a later round (AQ-SGD's case); the StageServer then
  keeps the device's cache between sessions (:mod:`fedpipe.server.delta_store`). Each
  cache carries an identity (:class:`CacheIdentity`): a random id made with the cache, the
  rows committed to it, and a running digest over every committed (key, row) that both
  sides advance with the same puts. A session resumes the server's copy only if the
  identities match; else both sides clear theirs, so a divergence costs one cold round,
  never a wrong activation. An encoder made per session (the default before) starts empty.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fedpipe.errors import TensorFormatError
from fedpipe.messages import StageMsg

__all__ = [
    "DELTA_BIT",
    "CacheIdentity",
    "DeltaCache",
    "DeltaDecoder",
    "DeltaEncoder",
    "DeltaRows",
]

DELTA_BIT = 1 << 63  # set in a sample key: the row is a difference from the key's base
_KEY_MASK = DELTA_BIT - 1
_FILE_FORMAT = "fedpipe-delta-1"
log = logging.getLogger(__name__)
_DIGEST_BYTES = 16
EMPTY_DIGEST = bytes(_DIGEST_BYTES)  # the digest of a cache no row was put in


@dataclass(frozen=True)
class CacheIdentity:
    """What two mirrored caches must share to hold the same rows (OpenSession's handshake).

    ``entries`` counts puts since the cache was made or cleared (rows later evicted
    included: evictions follow from the puts and the size); ``digest`` chains a BLAKE2b
    hash over each put's key and row bytes, so equal identities mean equal histories.
    """

    cache_id: str
    entries: int
    digest: bytes


class DeltaCache:
    """Last decoded row per sample key, at most ``max_bytes``; the oldest put goes first.

    ``get`` has no side effect (no reordering), so the two mirrored caches need only see
    the same ``put`` calls in the same order to stay identical; every put advances the
    cache's :class:`CacheIdentity`, so the two sides can later check that they did.
    """

    def __init__(self, max_bytes: int, *, cache_id: str | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"a delta cache holds >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.cache_id = cache_id if cache_id is not None else os.urandom(16).hex()
        self.entries = 0
        self.digest = EMPTY_DIGEST
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()

    @property
    def identity(self) -> CacheIdentity:
        return CacheIdentity(self.cache_id, self.entries, self.digest)

    def clear(self) -> None:
        """Drop every row and restart the history (the id stays: it names this cache)."""
        self._rows.clear()
        self.nbytes = 0
        self.entries = 0
        self.digest = EMPTY_DIGEST

    def get(self, key: int) -> torch.Tensor | None:
        return self._rows.get(key)

    def put(self, key: int, row: torch.Tensor) -> None:
        """Store ``row`` (owned by the cache from now on) as ``key``'s newest value."""
        self.entries += 1
        self.digest = _advance(self.digest, key, row)
        old = self._rows.pop(key, None)
        if old is not None:
            self.nbytes -= _nbytes(old)
        size = _nbytes(row)
        if size > self.max_bytes:
            return  # larger than the whole cache: never stored, on either side
        self._rows[key] = row
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, evicted = self._rows.popitem(last=False)
            self.nbytes -= _nbytes(evicted)

    def restore(self, rows: Iterable[tuple[int, torch.Tensor]], identity: CacheIdentity) -> None:
        """Refill the cache as it was saved: its rows (oldest first) and identity."""
        self.clear()
        for key, row in rows:
            self._rows[key] = row
            self.nbytes += _nbytes(row)
        self.cache_id, self.entries, self.digest = (
            identity.cache_id,
            identity.entries,
            identity.digest,
        )

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: int) -> bool:
        return key in self._rows


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _advance(digest: bytes, key: int, row: torch.Tensor) -> bytes:
    """The chained digest after putting ``row`` under ``key`` (shape and dtype included)."""
    h = hashlib.blake2b(digest, digest_size=_DIGEST_BYTES)
    h.update(key.to_bytes(8, "little"))
    h.update(f"{tuple(row.shape)}{row.dtype}".encode())
    h.update(row.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


@dataclass
class DeltaRows:
    """One message's rows: their keys, and the bases of the rows sent as differences."""

    keys: list[int]
    bases: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> base

    @property
    def wire_keys(self) -> tuple[int, ...]:
        return tuple(k | DELTA_BIT if i in self.bases else k for i, k in enumerate(self.keys))


def _rebuild(
    decoded: torch.Tensor, plan: DeltaRows, cache: DeltaCache, *, check: str = ""
) -> torch.Tensor:
    """``decoded`` with each difference row's base added back, in place; stores every row.

    With ``check`` (the message, for the error), a rebuilt row that overflowed to NaN or Inf
    (a finite difference from a finite base can) is refused before anything is stored.
    """
    for row, base in plan.bases.items():
        decoded[row].add_(base)
    if check:
        for row in plan.bases:
            if not bool(torch.isfinite(decoded[row]).all()):
                raise TensorFormatError(
                    f"{check}: row {row} holds NaN or Inf once its base is added back (the "
                    "difference overflowed); send values of a sane magnitude"
                )
    for row, key in enumerate(plan.keys):
        cache.put(key, decoded[row].clone())  # a copy: the batch tensor is not pinned
    return decoded


class DeltaEncoder:
    """The device's side: chooses differences, and mirrors the server's cache."""

    def __init__(self, max_bytes: int, *, salt: bytes | None = None) -> None:
        self.cache = DeltaCache(max_bytes)
        self._salt = salt if salt is not None else os.urandom(16)
        self.rows_delta = 0  # rows sent as differences (cache hits), since made
        self.rows_whole = 0  # rows sent whole (misses), since made

    def reset(self) -> None:
        """Start empty (the server did not resume this cache); keys keep their salt."""
        self.cache.clear()

    def save(self, path: Path) -> None:
        """Write the salt, the cache and its identity to ``path`` (owner-only, atomically).

        For devices whose training process does not outlive a round (Flower runs each
        ClientApp message in a new process by default): the next round loads it back. The
        file holds activations of the device's own data, so it stays on the device.
        """
        c = self.cache
        meta = {
            "format": _FILE_FORMAT,
            "keys": json.dumps(list(c._rows)),  # oldest first: the eviction order
            "cache_id": c.cache_id,
            "entries": str(c.entries),
            "digest": c.digest.hex(),
            "salt": self._salt.hex(),
            "max_bytes": str(c.max_bytes),
        }
        rows = {f"{i:08d}": row.contiguous() for i, row in enumerate(c._rows.values())}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(rows, str(tmp), metadata=meta)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, max_bytes: int) -> DeltaEncoder | None:
        """The encoder saved at ``path``; None if there is none, or one of another size.

        A file that cannot be read is ignored (with a warning): a new cache costs one round
        of whole sends, and the server resumes nothing that does not match.
        """
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != _FILE_FORMAT or int(meta["max_bytes"]) != max_bytes:
                    return None
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            encoder = cls(max_bytes, salt=bytes.fromhex(meta["salt"]))
            keys = [int(k) for k in json.loads(meta["keys"])]
            rows = [tensors[f"{i:08d}"] for i in range(len(keys))]
        except (OSError, ValueError, KeyError, SafetensorError) as exc:
            log.warning("ignoring the delta cache file %s (%s); starting a new one", path, exc)
            return None
        identity = CacheIdentity(
            meta["cache_id"], int(meta["entries"]), bytes.fromhex(meta["digest"])
        )
        encoder.cache.restore(zip(keys, rows, strict=True), identity)
        return encoder

    def keys_for(self, inputs: torch.Tensor) -> list[int]:
        """One salted 63-bit key per row of ``inputs`` (token ids, (b, T))."""
        rows = inputs.detach().to(torch.int64).cpu().contiguous()
        return [
            int.from_bytes(
                hashlib.blake2b(row.numpy().tobytes(), key=self._salt, digest_size=8).digest(),
                "little",
            )
            & _KEY_MASK
            for row in rows
        ]

    def prepare(self, x: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, DeltaRows]:
        """(what to encode, the plan): rows with a base become their difference from it."""
        if inputs.shape[0] != x.shape[0]:
            raise ValueError(
                f"delta coding needs one row of token ids per activation row: got "
                f"{inputs.shape[0]} rows of ids for an activation of shape {tuple(x.shape)}"
            )
        plan = DeltaRows(self.keys_for(inputs))
        x = x.detach().to(torch.float32).cpu()
        for row, key in enumerate(plan.keys):
            base = self.cache.get(key)
            if base is not None and base.shape == x.shape[1:]:
                plan.bases[row] = base
        self.rows_delta += len(plan.bases)
        self.rows_whole += len(plan.keys) - len(plan.bases)
        if not plan.bases:
            return x, plan
        x = x.clone()
        for row, base in plan.bases.items():
            x[row].sub_(base)
        return x, plan

    def commit(self, plan: DeltaRows, decoded: torch.Tensor) -> torch.Tensor:
        """Store what the receiver rebuilds from ``decoded`` (the sender's decode of its send)."""
        return _rebuild(decoded, plan, self.cache)


class DeltaDecoder:
    """The server's side: rebuilds rows sent as differences, and mirrors the device's cache."""

    def __init__(self, max_bytes: int, *, cache: DeltaCache | None = None) -> None:
        self.cache = cache if cache is not None else DeltaCache(max_bytes)

    def apply(self, msg: StageMsg) -> None:
        """Replace ``msg.tensor`` by the rebuilt activation (a no-op without sample keys)."""
        if not msg.sample_keys or msg.tensor is None:
            return
        t = msg.tensor
        if len(msg.sample_keys) != t.shape[0]:
            raise TensorFormatError(
                f"{msg}: {len(msg.sample_keys)} sample keys for {t.shape[0]} rows; "
                "send one key per row"
            )
        plan = DeltaRows([k & _KEY_MASK for k in msg.sample_keys])
        for row, wire_key in enumerate(msg.sample_keys):
            if wire_key & DELTA_BIT:
                plan.bases[row] = self._base(msg, row, plan.keys[row], tuple(t.shape[1:]))
        msg.tensor = _rebuild(t.to(torch.float32), plan, self.cache, check=str(msg))

    def _base(self, msg: StageMsg, row: int, key: int, shape: tuple[int, ...]) -> torch.Tensor:
        base = self.cache.get(key)
        if base is None or tuple(base.shape) != shape:
            held = "none" if base is None else f"one of shape {tuple(base.shape)}"
            raise TensorFormatError(
                f"{msg}: row {row} is a difference from sample {key:#x}, but this side holds "
                f"{held} (cache of {self.cache.max_bytes} bytes, {len(self.cache)} samples): "
                "the two sides' delta caches disagree; open the session with the same "
                "delta_cache_bytes on both sides"
            )
        return base
