"""Small frozen configuration dataclasses, validated on creation."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from sharding.layout import ShardingLayout

DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("float32", "bfloat16", "int8", "fp8")
QK_NORMS = ("head", "full")
# How a mixture of experts' tokens reach the devices of the expert axis (sharding/experts.py).
EXPERT_DISPATCHES = ("allgather", "all_to_all")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (HF `rope_type: llama3`) or linear."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer; hashable, so jit can key on it."""

    architecture: str  # registry key: "llama" (Llama 2/3, Mistral, Qwen2, SmolLM2), "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2)
    sliding_window: int | None = None  # Mistral: attend to at most this many keys
    dtype: str = "float32"  # parameter and activation dtype
    # Gemma 3: which layers are local (use `sliding_window`); None: every layer does.
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None  # RoPE base of the local layers (Gemma 3)
    query_pre_attn_scalar: float | None = None  # sm_scale = this ** -0.5; None: head_dim
    final_logit_softcap: float | None = None  # logits become cap * tanh(logits / cap)
    # RMSNorm of q and k before RoPE: "head" over each head (Qwen3), "full" over all heads at
    # once (OLMoE); None: none (Gemma 3 applies its own).
    qk_norm: str | None = None
    clip_qkv: float | None = None  # q, k and v clipped to [-c, c] (OLMoE); None: not clipped
    # Mixture of experts (engine/models/moe.py): every layer's MLP is `num_experts` experts of
    # width `intermediate_size`, `num_experts_per_tok` of them per token; 0: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.qk_norm not in (None, *QK_NORMS):
            raise ValueError(f"qk_norm must be one of {QK_NORMS} or None, got {self.qk_norm!r}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                f"{self.num_experts}"
            )
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(
                f"sliding_layers has {len(self.sliding_layers)} entries, "
                f"one per layer of {self.num_layers} expected"
            )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer (None: it attends to the whole context)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer has one (Mistral): keys behind it are never read again,
        so their pages can be freed. None when any layer sees the whole context."""
        if self.sliding_layers is not None and not all(self.sliding_layers):
            return None
        return self.sliding_window

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


QUANTIZATION_METHODS = ("int8", "int4")


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization of every linear layer: int8 per output channel, or int4 in
    groups of `group_size` along the input axis; the embedding/output layer is int8 in groups
    of 32 under both (see engine/weights/quantize.py).

    `int8_activations` (int4 only): on CPU, decode-sized products with the int4 weights and the
    int8 output layer round each activation row to int8 in blocks of 32, as llama.cpp's Q8_0
    does, and sum the products in integers (`pallas_kernels.cpu.quantized_matmul`); the key and
    value projections, prefill chunks of more than 64 rows and other platforms keep float
    activations (`engine.models.quant.with_int8_activations`)."""

    method: str  # "int8" | "int4"
    group_size: int = 32  # int4 only: 32, 64 or 128
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS}, got {self.method!r}"
            )
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"int4 group size must be 32, 64 or 128, got {self.group_size}")
        if self.int8_activations and self.method != "int4":
            raise ValueError(f"int8 activations need int4 weights, not {self.method}")

    @property
    def bits(self) -> int:
        return 8 if self.method == "int8" else 4


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: page size and how much memory it may take.

    Exactly one budget applies: `num_pages` if given, else `memory_bytes`, else
    `memory_fraction` of the accelerator memory left after the weights (like vLLM's
    `--gpu-memory-utilization`); on CPU the default is a fixed 2 GiB.
    """

    page_size: int = 16
    num_pages: int | None = None
    memory_bytes: int | None = None
    memory_fraction: float = 0.5
    enable_prefix_caching: bool = True
    # None: the model's dtype, except float32 on CPU, where XLA has no bf16 gather or scatter
    # (a bf16 cache there costs a copy of the whole pool per layer and step); "bfloat16" on CPU
    # is read and written in place by the C++ kernels (pallas_kernels.cpu) where they build,
    # half the bytes and faster decode attention, but falls back to those copies where they do
    # not, hence not the default; "int8" / "fp8"
    # (e4m3): one byte per value plus a float32 scale per token and head
    # (pallas_kernels/kv_cache_update/layout.py)
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
            raise ValueError(
                f"kv cache dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"kv cache memory must be > 0 bytes, got {self.memory_bytes}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory fraction must be in (0, 1], got {self.memory_fraction}")

    def kv_dtype(self, model_dtype: str, platform: str) -> str:
        """The cache's dtype for a model of `model_dtype` on `platform`."""
        if self.kv_cache_dtype is not None:
            return self.kv_cache_dtype
        return "float32" if platform == "cpu" else model_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: per step, at most `max_num_seqs` sequences and
    `max_num_batched_tokens` tokens; `max_model_len` bounds prompt + output (None: the
    model's, at most DEFAULT_MAX_MODEL_LEN; see `resolve`). `async_scheduling`: step n+1 is
    scheduled and dispatched while step n runs, its sampled tokens fed to it on the device
    (engine/llm_engine.py); off: each step waits for the one before it. `stream_interval`
    (SGLang's --stream-interval): a running sequence hands out its first token at once, then
    its new tokens and text once that many have gathered, and the rest when it finishes; 1
    hands out every token as it comes, larger values cut the deltas that cross to the API
    server and its streams by up to that factor (an API server that falls behind merges a
    stream's waiting deltas anyway: bench/RESULTS.md)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    async_scheduling: bool = True
    stream_interval: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "stream_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running sequence needs a token per step)"
            )

    @property
    def model_len(self) -> int:
        """`max_model_len` of a resolved config."""
        if self.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet (SchedulerConfig.resolve)")
        return self.max_model_len

    def resolve(self, model_max_len: int) -> SchedulerConfig:
        """This config with `max_model_len` set: as given, else the model's limit capped at
        DEFAULT_MAX_MODEL_LEN (page tables grow with it)."""
        if self.max_model_len is not None:
            return self
        return dataclasses.replace(self, max_model_len=min(model_max_len, DEFAULT_MAX_MODEL_LEN))


DEFAULT_MAX_MODEL_LEN = 4096  # the model's own limit when smaller


@dataclass(frozen=True)
class CompilationConfig:
    """How the engine compiles its steps.

    `warm_up`: "eager" compiles every (tokens, sequences) bucket before the engine is returned;
    "background" returns at once and leaves the buckets to `Engine.warm_up_step` (a server
    compiles them while idle; a bucket a request needs first is compiled on the spot); "lazy"
    compiles a bucket when first used (one-off generation). Data-parallel and multi-process
    engines always warm up eagerly: every replica and process must hold each step before the
    first one runs.
    """

    cache_dir: str | None = None  # XLA's persistent compilation cache; None: off
    warm_up: str = "eager"
    attention_impl: str | None = None  # None: the platform's kernel (pallas_kernels)

    def __post_init__(self) -> None:
        if self.warm_up not in WARM_UP_MODES:
            raise ValueError(f"warm_up must be one of {WARM_UP_MODES}, got {self.warm_up!r}")


WARM_UP_MODES = ("eager", "background", "lazy")


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Grammar compilation for structured output (engine/structured): compiled grammars kept
    (least recently used dropped first), how long a request waits for its grammar before it is
    refused, and the worker threads that compile them (the engine loop never waits)."""

    cache_size: int = 256
    compile_timeout_s: float = 10.0
    compile_threads: int = 2

    def __post_init__(self) -> None:
        if self.cache_size < 1:
            raise ValueError(f"grammar cache_size must be >= 1, got {self.cache_size}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if self.compile_threads < 1:
            raise ValueError(f"compile_threads must be >= 1, got {self.compile_threads}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine spans devices and processes: a sharding layout (mesh axes and the table
    from logical axes to them; `--tensor/pipeline/data-parallel-size` are named layouts), and,
    for an engine over several processes, where they meet (all three given, or none).
    `expert_dispatch`: how a mixture of experts' tokens reach the devices of the layout's
    expert axis (sharding/experts.py: "allgather" keeps every token on every device and sums
    the experts' parts; "all_to_all" sends each token to its experts' devices and back)."""

    layout: ShardingLayout = field(default_factory=ShardingLayout.named)
    coordinator_address: str | None = None  # HOST:PORT of process 0
    num_processes: int | None = None
    process_id: int | None = None
    expert_dispatch: str = "allgather"  # one of EXPERT_DISPATCHES

    def __post_init__(self) -> None:
        if self.expert_dispatch not in EXPERT_DISPATCHES:
            raise ValueError(
                f"expert dispatch must be one of {', '.join(EXPERT_DISPATCHES)}, "
                f"not {self.expert_dispatch!r}"
            )
        given = (self.coordinator_address, self.num_processes, self.process_id)
        if any(x is None for x in given) and not all(x is None for x in given):
            raise ValueError("coordinator address, number of processes and process id go together")

    @property
    def multi_process(self) -> bool:
        return self.num_processes is not None


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags): `max_loras` adapters live in device slots at once
    (slot 0, all zeros, is the base model), each of rank at most `max_lora_rank`; at most
    `max_cpu_loras` parsed adapters are kept on the host (least recently used dropped first,
    re-read from disk when needed). `modules`: (name, path) pairs registered at start-up.
    `allowed_dirs`: the only directories adapters may be loaded from at runtime;
    `allow_runtime_updating` turns the load/unload endpoints on."""

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    modules: tuple[tuple[str, str], ...] = ()
    allowed_dirs: tuple[str, ...] = ()
    allow_runtime_updating: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}"
            )
        object.__setattr__(self, "modules", tuple(tuple(m) for m in self.modules))
        object.__setattr__(self, "allowed_dirs", tuple(self.allowed_dirs))
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA module names must be distinct, got {names}")

    @property
    def num_slots(self) -> int:
        """Device slots including slot 0, the base model."""
        return self.max_loras + 1

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative/), vLLM's `--speculative-config` shape.

    `ngram`: proposals copied from the request's own prompt and output after the longest
    suffix of `prompt_lookup_min`..`prompt_lookup_max` tokens seen before. Speculation is off
    for a step with more than `disable_by_batch_size` running sequences, and for a request
    whose acceptance rate after `acceptance_window` proposed tokens is below
    `min_acceptance_rate`; such a request tries again (a fresh window) after
    `acceptance_reprobe_steps` steps in which it could have speculated (None: never).
    `draft_model`: proposals sampled from `model`, a smaller model with the target's
    tokenizer, run in the same engine with its own paged cache.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # draft_model: the smaller model, same tokenizer
    # Measured (bench/speculative.py --concurrency 1 2 4 8 --disable-by-batch-size 8, n-gram
    # k=3, SmolLM2 on CPU): speculation lost on both workloads at 8 sequences, not at 4.
    disable_by_batch_size: int = 4
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 32
    acceptance_reprobe_steps: int | None = 128

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("a draft model (`model`) goes with method 'draft_model' only")
        if self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )
        if not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(
                f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}"
            )
        if self.acceptance_window < 1:
            raise ValueError(f"acceptance_window must be >= 1, got {self.acceptance_window}")
        if self.acceptance_reprobe_steps is not None and self.acceptance_reprobe_steps < 1:
            raise ValueError(
                f"acceptance_reprobe_steps must be >= 1 (or null: never), got "
                f"{self.acceptance_reprobe_steps}"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From `--speculative-config`'s JSON object; ValueError names a bad or unknown key."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from e
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown --speculative-config keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"--speculative-config: {e}") from e


@dataclass(frozen=True)
class ObservabilityConfig:
    """Optional metrics that cost device work. `expert_token_counts`: each step also counts a
    mixture of experts' tokens per layer and expert (load balance: EngineStats.expert_tokens,
    `xlaserve:expert_tokens_total`); off, the compiled step is the same as without it."""

    expert_token_counts: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Everything `engine.builder.build_engine` needs, in one hashable value.

    `model`: an alias (`smollm2-135m`, `gemma3-270m`), a Hugging Face checkpoint directory, a
    `.gguf` file or a directory written by `xlaserve convert`. `dtype` None: float32, or what a
    converted directory holds.
    """

    model: str = "smollm2-135m"
    dtype: str | None = None
    quantization: QuantizationConfig | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    lora: LoRAConfig | None = None  # None: no adapters (--enable-lora off)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
