"""Engine configuration: dataclasses validated at construction (no module globals)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Literal, get_args

from engine.kv_groups import KV_LAYOUTS
from engine.model.default_model import DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    import torch


class Role(str, Enum):
    """A worker's role, the one owner of the role names (router, deploy, the workers and the engine
    take them from here). A member equals its name (`Role.BOTH == "both"`), so the command-line
    spellings and what travels in messages and JSON stay plain strings; `Role.parse` checks one.
    `pool`: what users call the role's pool ("colocated" for "both": `--colocated`, `pdserve
    status`); `sends_kv` / `imports_kv`: which end of the KV hand-off its workers are (a colocated
    worker moves no KV); `decodes`: the router streams generations from it."""
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, role: str) -> Role:
        try:
            return cls(role)
        except ValueError:
            raise ValueError(f"role must be one of {', '.join(cls)}, got {role!r}") from None

    @property
    def pool(self) -> str:
        return "colocated" if self is Role.BOTH else self.value

    @property
    def sends_kv(self) -> bool:
        return self is Role.PREFILL

    @property
    def imports_kv(self) -> bool:
        return self is Role.DECODE

    @property
    def moves_kv(self) -> bool:
        return self.sends_kv or self.imports_kv

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL


# Every role, and its subsets: the roles that decode (the router streams from them; a decode
# worker's default role comes first) and the roles that move KV between workers.
ROLES: tuple[Role, ...] = tuple(Role)
DECODE_ROLES: tuple[Role, ...] = tuple(role for role in Role if role.decodes)
KV_ROLES: tuple[Role, ...] = tuple(role for role in Role if role.moves_kv)

# A decode-role worker prefills only what the router keeps local (a short tail, or a prompt the
# prefill pool is too busy for); its decodes come first, so by default such a step takes at most
# twice the decode-only step (`SchedulerConfig.max_step_ratio`; `build_engine_config` applies it).
DECODE_ROLE_MAX_STEP_RATIO = 2.0
# A prefill worker runs a long prompt in chunks of at most this many tokens, so a short prompt
# arriving meanwhile waits for one chunk and passes between the chunks instead of queueing behind
# the whole prompt (`SchedulerConfig.long_prefill_chunk_tokens`; `build_engine_config` applies it),
# by device: a CPU core computes ~200-250 prompt tokens/s of the default model, so 128 is about
# half a second (on the interference workload short-request TTFT p99 fell with the chunk: 512 3.8 s,
# 256 3.1-3.8 s, 128 2.2 s, at about the same ITL and long-prompt TTFT; benchmarks/README.md); a
# GPU runs 1024 in milliseconds.
PREFILL_ROLE_LONG_CHUNK_TOKENS = {"cpu": 128, "cuda": 1024}

# The one list of KV cache dtypes (`--kv-cache-dtype`): "auto" keeps the model's dtype; the 8-bit
# ones store values with per-block scales and K references (engine/kv_quant.py owns that format).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "int8")
KV_CACHE_DTYPE_HELP = ("auto: the model's dtype; int8 / fp8_e4m3: 8-bit KV with per-block scales (0.53x bf16's "
                       "bytes in the cache and on every transfer; every worker of a deployment must agree)")

# The one list of attention backends (`engine.attention.get_attention_backend` builds one by name);
# `EngineConfig.attention_backend` also takes "auto": by device (`default_backend_name`).
AttentionBackendName = Literal["cpu", "torch", "triton"]
BACKEND_NAMES: tuple[str, ...] = get_args(AttentionBackendName)

# torch is imported where a dtype or a device is resolved, not here: the control plane (deploy,
# `pdserve status`, the router's spec) reads these configs without loading torch.
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """`auto` is fp32 on CPU (exact and fastest there) and bf16 on CUDA."""
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return getattr(torch, _DTYPES[dtype])


def resolve_device(device: str) -> str:
    if device == "cpu":
        return device
    if not (device == "auto" or device.startswith("cuda")):
        raise ValueError(f"unknown device {device!r}; choose auto, cpu or cuda")
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return device


@dataclass
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks. None: sized from `kv_cache_memory_gb` (or GPU memory utilization).
    num_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    # Host memory for swap preemption (`preemption_mode="swap"`), in GiB; unused otherwise.
    swap_space_gb: float = 4.0
    # Host-memory tier of the prefix cache (engine/host_cache.py), in GiB; 0: off. Evicted cached
    # blocks are kept there and copied back on a later prefix hit (idle agent sessions).
    host_cache_gb: float = 0.0
    # CPU: allocate the KV cache in shared memory (a memfd) that a same-host KV receiver can map;
    # prefill workers set it so kvtransfer's shm transport copies blocks out in one memcpy.
    shared_memory: bool = False
    # Record KV-cache events (engine/kv_events.py) for `AsyncEngine.subscribe_kv_events`; the
    # workers turn it on (their routers follow the events), the offline engine leaves it off.
    kv_events: bool = False
    # "auto": the model's dtype; "fp8_e4m3" / "int8": 8-bit values with a float32 scale per block,
    # K/V and KV head and a bf16 K reference row per block and head, stored in the block
    # (engine/kv_quant.py): 0.53x bf16's bytes per token at head_dim 64.
    kv_cache_dtype: str = "auto"
    # engine/kv_groups.py: "auto" gives sliding-window layers' blocks behind their window back to
    # the pool where the configuration allows it; "grouped" insists (refused where it does not
    # work yet); "uniform" keeps every layer's blocks for every token.
    kv_layout: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if self.host_cache_gb < 0:
            raise ValueError(f"host_cache_gb must be >= 0, got {self.host_cache_gb}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # per-step token budget (decodes + prefill chunks)
    max_num_seqs: int = 128  # cap on running requests
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # While decodes run, cap each step's prefill tokens so the step should take at most this long
    # (engine/step_cost.py learns the cost per token); None: only max_num_batched_tokens caps it.
    max_step_ms: float | None = None
    # The same, relative: a step with prefill chunks takes at most this many times the decode-only
    # step (learned). Adapts to the hardware; the decode role's default is DECODE_ROLE_MAX_STEP_RATIO.
    max_step_ratio: float | None = None
    # A prompt runs at most this many tokens per step (the rest of the budget admits others, and
    # one arriving meanwhile waits for one chunk); None: the budget alone decides. The prefill
    # role's default is PREFILL_ROLE_LONG_CHUNK_TOKENS.
    long_prefill_chunk_tokens: int | None = None

    @property
    def step_target_set(self) -> bool:
        """Whether prefill chunks are capped by a step target (a ratio of inf caps nothing)."""
        return self.max_step_ms is not None or self.max_step_ratio not in (None, float("inf"))

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0 when set, got {self.max_step_ms}")
        if self.max_step_ratio is not None and not self.max_step_ratio > 1:
            raise ValueError(f"max_step_ratio must be > 1 when set, got {self.max_step_ratio}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.long_prefill_chunk_tokens is not None and self.long_prefill_chunk_tokens < 1:
            raise ValueError(f"long_prefill_chunk_tokens must be >= 1 when set, got {self.long_prefill_chunk_tokens}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")


# Speculative decoding methods (engine/speculative.py); a draft model would be the next one.
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram",)


@dataclass
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py), off unless `speculative_method` is set. The
    field names are also the flat options of `build_engine_config` and `LLM(...)`."""
    speculative_method: str | None = None  # None: off; "ngram": prompt lookup in the request's own tokens
    num_speculative_tokens: int = 4  # draft tokens per decode step, at most
    prompt_lookup_min: int = 2  # n-gram: the shortest suffix of the tokens so far that may match
    prompt_lookup_max: int = 4  # n-gram: the longest (tried first)
    # No drafts in a step with more decodes than this (None: always): at large batches a CPU step
    # is compute-bound, and verifying k extra tokens per sequence costs more than it saves.
    speculative_disable_by_batch_size: int | None = None

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None

    def __post_init__(self) -> None:
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)} (or None: off), "
                             f"got {self.speculative_method!r}")
        checks = [
            (isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
             "num_speculative_tokens must be an integer in [1, 16]"),
            (isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
             "prompt_lookup_min must be an integer >= 1"),
            (isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
             "prompt_lookup_max must be an integer >= prompt_lookup_min"),
            (self.speculative_disable_by_batch_size is None or self.speculative_disable_by_batch_size >= 1,
             "speculative_disable_by_batch_size must be >= 1 when set"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# How a checkpoint's weights are held (`--quantization`): "none" dequantizes whatever the file
# stores to the model's dtype at load; "gguf" keeps a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 /
# Q4_K / Q5_K / Q6_K blocks as stored (engine/model/gguf_quantized.py; other formats in the file stay float);
# "int8" quantizes a float model's projections, embedding and LM head to Q8_0 at load (int8 with a
# scale per 32); "fp8" / "awq" / "gptq" keep a Hugging Face checkpoint's quantized tensors as stored
# (engine/model/hf_quantized.py, the formats in engine/model/quant_formats.py); "auto" keeps what the
# hardware serves well (`ModelRunner._keep_quantized`): a GGUF's blocks on CPU, an fp8 / AWQ / GPTQ
# checkpoint on GPUs, else none.
HF_QUANT_METHODS = ("fp8", "awq", "gptq")
QUANTIZATIONS = ("none", "auto", "gguf", "int8", *HF_QUANT_METHODS)
QUANTIZATION_HELP = ("none (default): weights dequantized at load to the model's dtype; gguf: a .gguf model's "
                     "Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights kept as stored (others stay float); "
                     "int8: any float model's weights quantized at load to int8 with a scale per 32 (GGUF's Q8_0); "
                     "fp8, awq, gptq: a Hugging Face checkpoint's quantized weights kept as stored, served by Triton "
                     "kernels; auto: gguf for a .gguf on CPU, the checkpoint's format on GPUs, else none")


def add_engine_arguments(group) -> None:
    """The engine flags of every command that starts workers (an argparse group): `pdserve serve`
    gives them to each of its workers, a worker started by hand takes them itself. Unset ones stay
    None, so the engine's (and the role's) defaults apply; `engine_options` collects the rest."""
    group.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
    group.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    group.add_argument("--block-size", type=int, default=None, help="tokens per KV block, the same on every worker "
                                                                    "(default 16)")
    group.add_argument("--kv-cache-blocks", "--num-blocks", dest="num_blocks", type=int, default=None,
                       help="KV blocks per worker (default: from --kv-cache-memory-gb)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV cache per worker on CPU")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None, help=KV_CACHE_DTYPE_HELP)
    group.add_argument("--kv-layout", choices=KV_LAYOUTS, default=None,
                       help="auto (default): sliding-window layers give their blocks behind the window back to the "
                            "pool (decode and colocated workers; not with TP on a decode worker, swap or the host "
                            "tier); uniform: keep them")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="per-step token budget")
    group.add_argument("--max-num-seqs", type=int, default=None, help="cap on running requests per worker")
    group.add_argument("--max-step-ms", type=float, default=None,
                       help="while decodes run, size prefill chunks so a step takes about this long (ITL bound)")
    group.add_argument("--max-step-ratio", type=float, default=None,
                       help="the same, relative: a step with prefill takes at most this many times the decode-only "
                            f"step (decode role default {DECODE_ROLE_MAX_STEP_RATIO:g}; inf: off)")
    group.add_argument("--prefill-chunk-tokens", dest="long_prefill_chunk_tokens", type=int, default=None,
                       help="a prompt runs at most this many tokens per step, so one arriving meanwhile waits for "
                            "one chunk (prefill role default: "
                            + ", ".join(f"{n} on {d}" for d, n in PREFILL_ROLE_LONG_CHUNK_TOKENS.items()) + ")")
    group.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    group.add_argument("--no-cuda-graphs", action="store_true",
                       help="GPU: run decode steps eagerly instead of replaying CUDA graphs")
    group.add_argument("--preemption-mode", choices=("recompute", "swap"), default=None,
                       help="when KV blocks run out: recompute the victim later (default) or swap its KV to host memory")
    group.add_argument("--swap-space-gb", type=float, default=None,
                       help="host memory per worker for swap preemption (default 4)")
    group.add_argument("--host-cache-gb", type=float, default=None,
                       help="host memory per worker for the prefix cache's second tier: evicted KV blocks are kept "
                            "there and copied back on a later hit (idle agent sessions); default 0, off")
    add_speculative_arguments(group)


def engine_options(args) -> dict:
    """The flags of `add_engine_arguments` that were given, as `engine.llm.build_engine_config` options."""
    names = ("dtype", "quantization", "block_size", "num_blocks", "kv_cache_memory_gb", "kv_cache_dtype", "kv_layout",
             "max_num_batched_tokens",
             "max_num_seqs", "max_step_ms", "max_step_ratio", "long_prefill_chunk_tokens", "max_model_len",
             "preemption_mode", "swap_space_gb", "host_cache_gb")
    options = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.no_cuda_graphs:
        options["cuda_graphs"] = False
    options.update(speculative_options(args))
    return options


def add_speculative_arguments(group) -> None:
    """The speculative-decoding flags (part of `add_engine_arguments`)."""
    group.add_argument("--speculative", dest="speculative_method", choices=SPECULATIVE_METHODS, default=None,
                       help="speculative decoding on decode and colocated workers; ngram: draft tokens looked up "
                            "in the request's own prompt and output (default: off)")
    group.add_argument("--num-speculative-tokens", type=int, default=None,
                       help="draft tokens per decode step, at most (default 4)")
    group.add_argument("--prompt-lookup-min", type=int, default=None,
                       help="ngram: shortest suffix that may match (default 2)")
    group.add_argument("--prompt-lookup-max", type=int, default=None,
                       help="ngram: longest suffix tried first (default 4)")
    group.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                       help="no drafts in a step with more decodes than this (default: always draft)")


def speculative_options(args) -> dict:
    """The flags of `add_speculative_arguments` that were given, as engine options."""
    names = ("speculative_method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "speculative_disable_by_batch_size")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL_NAME
    dtype: str = "auto"
    quantization: str = "none"  # QUANTIZATIONS
    device: str = "auto"
    attention_backend: Literal["auto"] | AttentionBackendName = "auto"
    role: Role = Role.BOTH  # (a role's name is parsed into its Role)
    max_model_len: int | None = None  # None: the model's own context length
    # On CUDA (Triton backend), replay decode-only steps as CUDA graphs (engine/cuda_graphs.py).
    cuda_graphs: bool = True
    seed: int = 0
    # Processes (one device each on CUDA) that split the model's heads and MLP (engine/parallel.py);
    # rank 0 is this engine and starts the others (engine/tp_worker.py). 1: one process.
    tensor_parallel_size: int = 1
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        self.role = Role.parse(self.role)
        if self.attention_backend not in ("auto", *BACKEND_NAMES):
            raise ValueError(f"attention_backend must be auto or one of {', '.join(BACKEND_NAMES)}, "
                             f"got {self.attention_backend!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        self.device = resolve_device(self.device)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization in ("gguf", "int8") and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on CPU (its kernels are native CPU code); "
                             "use quantization 'none' or 'auto' on a GPU")
        if self.speculative.enabled and self.cache.kv_cache_dtype != "auto":
            # A draft token's K/V can grow its block's scale, which re-rounds the tokens before it;
            # rejecting the draft does not undo that, so outputs would differ from decoding without it.
            raise ValueError(f"speculative decoding is not supported with an 8-bit KV cache "
                             f"(kv_cache_dtype {self.cache.kv_cache_dtype!r}) yet: it would change outputs; "
                             "use one or the other")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)

    @property
    def backend_name(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        from engine.attention.backend import default_backend_name  # torch: only the model runner asks
        return default_backend_name(self.device)
