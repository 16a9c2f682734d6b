from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    FP32: _ClassVar[Codec]
    BF16: _ClassVar[Codec]
    FP16: _ClassVar[Codec]
    INT8: _ClassVar[Codec]
    INT4: _ClassVar[Codec]
    INT2: _ClassVar[Codec]

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    ACTIVATION: _ClassVar[Kind]
    OUTPUT: _ClassVar[Kind]
    OUTPUT_GRAD: _ClassVar[Kind]
    INPUT_GRAD: _ClassVar[Kind]
    STEP_END: _ClassVar[Kind]
    STEP_DONE: _ClassVar[Kind]
    ERROR: _ClassVar[Kind]
    ECHO: _ClassVar[Kind]
CODEC_UNSPECIFIED: Codec
FP32: Codec
BF16: Codec
FP16: Codec
INT8: Codec
INT4: Codec
INT2: Codec
KIND_UNSPECIFIED: Kind
ACTIVATION: Kind
OUTPUT: Kind
OUTPUT_GRAD: Kind
INPUT_GRAD: Kind
STEP_END: Kind
STEP_DONE: Kind
ERROR: Kind
ECHO: Kind

class Tensor(_message.Message):
    __slots__ = ("codec", "shape", "data", "scales", "group_size", "token_groups", "outliers")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    OUTLIERS_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    scales: bytes
    group_size: int
    token_groups: bool
    outliers: int
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., group_size: _Optional[int] = ..., token_groups: _Optional[bool] = ..., outliers: _Optional[int] = ...) -> None: ...

class StageMessage(_message.Message):
    __slots__ = ("session_id", "step", "microbatch", "kind", "tensor", "labels", "loss_scale", "loss_sum", "tokens", "error", "compute_s", "forward_only", "sample_keys", "checksum", "segment_lengths")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    microbatch: int
    kind: Kind
    tensor: Tensor
    labels: Tensor
    loss_scale: float
    loss_sum: float
    tokens: int
    error: str
    compute_s: float
    forward_only: bool
    sample_keys: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    segment_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., labels: _Optional[_Union[Tensor, _Mapping]] = ..., loss_scale: _Optional[float] = ..., loss_sum: _Optional[float] = ..., tokens: _Optional[int] = ..., error: _Optional[str] = ..., compute_s: _Optional[float] = ..., forward_only: _Optional[bool] = ..., sample_keys: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., segment_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class SplitSpec(_message.Message):
    __slots__ = ("model", "num_layers", "head_layers", "tail_layers", "mode", "hidden_size", "dtype", "fingerprint", "max_positions", "vocab_size", "cuts")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEAD_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TAIL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CUTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    head_layers: int
    tail_layers: int
    mode: str
    hidden_size: int
    dtype: str
    fingerprint: str
    max_positions: int
    vocab_size: int
    cuts: _containers.RepeatedCompositeFieldContainer[SplitCut]
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., head_layers: _Optional[int] = ..., tail_layers: _Optional[int] = ..., mode: _Optional[str] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., fingerprint: _Optional[str] = ..., max_positions: _Optional[int] = ..., vocab_size: _Optional[int] = ..., cuts: _Optional[_Iterable[_Union[SplitCut, _Mapping]]] = ...) -> None: ...

class SplitCut(_message.Message):
    __slots__ = ("head_layers", "tail_layers")
    HEAD_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TAIL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    head_layers: int
    tail_layers: int
    def __init__(self, head_layers: _Optional[int] = ..., tail_layers: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("device_id", "token", "round", "uplink_codec", "downlink_codec", "microbatch_size", "seq_len", "learning_rate", "weight_decay", "gradient_codec", "split", "frozen_head", "error_feedback", "delta_cache_bytes", "delta_cache_id", "delta_cache_entries", "delta_cache_digest", "stochastic_rounding", "downlink_codec_name", "gradient_codec_name")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    UPLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CODEC_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    FROZEN_HEAD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    DELTA_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DELTA_CACHE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STOCHASTIC_ROUNDING_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_CODEC_NAME_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CODEC_NAME_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    token: str
    round: int
    uplink_codec: Codec
    downlink_codec: Codec
    microbatch_size: int
    seq_len: int
    learning_rate: float
    weight_decay: float
    gradient_codec: Codec
    split: SplitSpec
    frozen_head: bool
    error_feedback: bool
    delta_cache_bytes: int
    delta_cache_id: str
    delta_cache_entries: int
    delta_cache_digest: bytes
    stochastic_rounding: bool
    downlink_codec_name: str
    gradient_codec_name: str
    def __init__(self, device_id: _Optional[str] = ..., token: _Optional[str] = ..., round: _Optional[int] = ..., uplink_codec: _Optional[_Union[Codec, str]] = ..., downlink_codec: _Optional[_Union[Codec, str]] = ..., microbatch_size: _Optional[int] = ..., seq_len: _Optional[int] = ..., learning_rate: _Optional[float] = ..., weight_decay: _Optional[float] = ..., gradient_codec: _Optional[_Union[Codec, str]] = ..., split: _Optional[_Union[SplitSpec, _Mapping]] = ..., frozen_head: _Optional[bool] = ..., error_feedback: _Optional[bool] = ..., delta_cache_bytes: _Optional[int] = ..., delta_cache_id: _Optional[str] = ..., delta_cache_entries: _Optional[int] = ..., delta_cache_digest: _Optional[bytes] = ..., stochastic_rounding: _Optional[bool] = ..., downlink_codec_name: _Optional[str] = ..., gradient_codec_name: _Optional[str] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session_id", "split", "max_message_bytes", "delta_resumed", "delta_reset_reason", "stream_key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_RESUMED_FIELD_NUMBER: _ClassVar[int]
    DELTA_RESET_REASON_FIELD_NUMBER: _ClassVar[int]
    STREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    split: SplitSpec
    max_message_bytes: int
    delta_resumed: bool
    delta_reset_reason: str
    stream_key: str
    def __init__(self, session_id: _Optional[str] = ..., split: _Optional[_Union[SplitSpec, _Mapping]] = ..., max_message_bytes: _Optional[int] = ..., delta_resumed: _Optional[bool] = ..., delta_reset_reason: _Optional[str] = ..., stream_key: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    def __init__(self, steps: _Optional[int] = ...) -> None: ...

class BeginRoundRequest(_message.Message):
    __slots__ = ("round", "run_id", "aggregation", "rule", "frozen_below", "window")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    FROZEN_BELOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    round: int
    run_id: str
    aggregation: str
    rule: str
    frozen_below: int
    window: int
    def __init__(self, round: _Optional[int] = ..., run_id: _Optional[str] = ..., aggregation: _Optional[str] = ..., rule: _Optional[str] = ..., frozen_below: _Optional[int] = ..., window: _Optional[int] = ...) -> None: ...

class BeginRoundReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceWeight(_message.Message):
    __slots__ = ("device_id", "weight")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    weight: float
    def __init__(self, device_id: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class CommitRoundRequest(_message.Message):
    __slots__ = ("round", "finished")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    round: int
    finished: _containers.RepeatedCompositeFieldContainer[DeviceWeight]
    def __init__(self, round: _Optional[int] = ..., finished: _Optional[_Iterable[_Union[DeviceWeight, _Mapping]]] = ...) -> None: ...

class SessionUpdate(_message.Message):
    __slots__ = ("device_id", "round", "weight")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    round: int
    weight: float
    def __init__(self, device_id: _Optional[str] = ..., round: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class CommitUpdatesRequest(_message.Message):
    __slots__ = ("round", "merge", "discard", "server_lr")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MERGE_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    SERVER_LR_FIELD_NUMBER: _ClassVar[int]
    round: int
    merge: _containers.RepeatedCompositeFieldContainer[SessionUpdate]
    discard: _containers.RepeatedCompositeFieldContainer[SessionUpdate]
    server_lr: float
    def __init__(self, round: _Optional[int] = ..., merge: _Optional[_Iterable[_Union[SessionUpdate, _Mapping]]] = ..., discard: _Optional[_Iterable[_Union[SessionUpdate, _Mapping]]] = ..., server_lr: _Optional[float] = ...) -> None: ...

class CommitRoundReply(_message.Message):
    __slots__ = ("merged", "discarded", "dropped", "dropped_reason")
    MERGED_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    merged: int
    discarded: int
    dropped: _containers.RepeatedScalarFieldContainer[str]
    dropped_reason: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, merged: _Optional[int] = ..., discarded: _Optional[int] = ..., dropped: _Optional[_Iterable[str]] = ..., dropped_reason: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("data", "total_bytes", "sha256", "reset")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    sha256: bytes
    reset: bool
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ..., reset: _Optional[bool] = ...) -> None: ...

class LoadAdapterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("server_id",)
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    def __init__(self, server_id: _Optional[str] = ...) -> None: ...

class RoundStatusRequest(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("device_id", "steps_done", "opened_s_ago", "first_step_s_ago", "last_step_s_ago", "closed", "rows_done", "tokens_done")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    OPENED_S_AGO_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_S_AGO_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_S_AGO_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ROWS_DONE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    steps_done: int
    opened_s_ago: float
    first_step_s_ago: float
    last_step_s_ago: float
    closed: bool
    rows_done: int
    tokens_done: int
    def __init__(self, device_id: _Optional[str] = ..., steps_done: _Optional[int] = ..., opened_s_ago: _Optional[float] = ..., first_step_s_ago: _Optional[float] = ..., last_step_s_ago: _Optional[float] = ..., closed: _Optional[bool] = ..., rows_done: _Optional[int] = ..., tokens_done: _Optional[int] = ...) -> None: ...

class RoundStatusReply(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStatus]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionStatus, _Mapping]]] = ...) -> None: ...

class CollectRoundRequest(_message.Message):
    __slots__ = ("round", "finished")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    round: int
    finished: _containers.RepeatedCompositeFieldContainer[DeviceWeight]
    def __init__(self, round: _Optional[int] = ..., finished: _Optional[_Iterable[_Union[DeviceWeight, _Mapping]]] = ...) -> None: ...

class CollectedPart(_message.Message):
    __slots__ = ("held", "discarded", "dropped", "dropped_reason", "microbatches", "round_s", "chunk")
    HELD_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    ROUND_S_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedCompositeFieldContainer[DeviceWeight]
    discarded: int
    dropped: _containers.RepeatedScalarFieldContainer[str]
    dropped_reason: _containers.RepeatedScalarFieldContainer[str]
    microbatches: int
    round_s: float
    chunk: AdapterChunk
    def __init__(self, held: _Optional[_Iterable[_Union[DeviceWeight, _Mapping]]] = ..., discarded: _Optional[int] = ..., dropped: _Optional[_Iterable[str]] = ..., dropped_reason: _Optional[_Iterable[str]] = ..., microbatches: _Optional[int] = ..., round_s: _Optional[float] = ..., chunk: _Optional[_Union[AdapterChunk, _Mapping]] = ...) -> None: ...
