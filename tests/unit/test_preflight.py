"""Preflight checks on their own: names, ports, protocols, splits, Flower's failure logs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fedpipe.cli.preflight import (
    SettingsError,
    check_data,
    check_examples,
    check_partition,
    default_split,
    did_you_mean,
)
from fedpipe.config import FedpipeConfig, load_config
from fedpipe.data import Document
from fedpipe.launch.processes import explain_failure
from fedpipe.models import load_tokenizer, resolve_model


def test_names_and_splits() -> None:
    assert did_you_mean("fedavgg", ["fedavg", "fedprox"]) == " (did you mean 'fedavg'?)"
    assert did_you_mean("zzz", ["fedavg"]) == ""
    # head = tail = 2 where the model allows it, always leaving the server a block
    assert [default_split(n) for n in (2, 3, 4, 5, 8, 30)] == [1, 1, 1, 2, 2, 2]


def test_partition_feasibility_under_each_scheme(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(3):  # three sources of ten documents each
        text = "\n\n".join(f"source {i} paragraph {j}. " * 300 for j in range(10))
        (folder / f"user{i}.txt").write_text(text)
    docs = check_data(str(folder), "federated.data")
    by_source = load_config(None, {"federated.data": str(folder)})
    check_partition(by_source, docs, 3)
    with pytest.raises(SettingsError, match="3 source.* for 4 devices"):
        check_partition(by_source, docs, 4)
    iid = load_config(None, {"federated.data": str(folder), "federated.partition": "iid"})
    check_partition(iid, docs, 8)


@pytest.mark.parametrize(
    ("log", "meaning"),
    [
        (
            "ERROR :     Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
            "[code: 2004] Failed to activate SuperNode.",
            "refused this SuperNode: register its public key",
        ),
        ("WARNING :   Connection attempt failed, retrying in 0.37 seconds", "could not reach"),
        ("OSError: [Errno 98] Address already in use", "already in use"),
        ("The `--enable-supernode-auth` flag requires encrypted TLS", "needs TLS"),
        ("INFO: all fine", ""),
    ],
)
def test_flower_failures_are_explained(log: str, meaning: str) -> None:
    assert meaning in explain_failure(log)
    if not meaning:
        assert explain_failure(log) == ""


def test_links_take_names_and_inline_specs() -> None:
    from fedpipe.cli.preflight import check_links
    from fedpipe.emulation import split_specs as split_links

    assert split_links("1gbit-5ms,up=10,down=25,rtt=50ms") == [
        "1gbit-5ms",
        "up=10,down=25,rtt=50ms",
    ]
    assert split_links("up=10,down=25,up=5,down=5,rtt=1ms") == [
        "up=10,down=25",
        "up=5,down=5,rtt=1ms",
    ]
    check_links(split_links("100mbit-5ms,up=10,down=25,rtt=50ms"))
    with pytest.raises(SettingsError, match="--links: unknown link '100mbit-5s'.*did you mean"):
        check_links(["100mbit-5s"])


def test_instruction_data_a_template_cannot_mask_is_refused_before_the_run(
    tmp_path: Path,
) -> None:
    chat = Document(
        messages=({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"})
    )
    check_examples(FedpipeConfig(), [chat], "federated.data")  # tiny-llama's template masks
    folder = tmp_path / "model"
    shutil.copytree(resolve_model("tiny-llama"), folder)
    tok = load_tokenizer(folder)
    tok.chat_template = (  # the last turn is written differently: prefixes do not add up
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    tok.save_pretrained(folder)
    cfg = FedpipeConfig().with_overrides({"model.name": str(folder)})
    with pytest.raises(SettingsError, match="federated.data: .*generation %}"):
        check_examples(cfg, [Document(text="plain"), chat], "federated.data")
    check_examples(cfg, [Document(text="plain")], "federated.data")  # plain text: no template
    check_examples(cfg.with_overrides({"data.loss_on": "all"}), [chat], "federated.data")
