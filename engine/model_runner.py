"""Turns a scheduled `Batch` into tensors, runs the model forward and samples.

The runner owns the model weights, the KV cache tensors, the attention backend and the sampler;
it never decides who runs (the scheduler does). Contract: `execute(batch)` returns, for every
scheduled sequence whose `sample` flag is set, its new tokens: one `SampledToken`, or for a decode
with a draft (speculative decoding, engine/speculative.py) the accepted draft tokens and one more.
A draft's positions run as one-query attention rows, one per position, like ordinary decodes.

Tensor parallelism (`config.tensor_parallel_size` N > 1; engine/parallel.py): the runner of rank 0
starts N-1 followers (engine/tp_worker.py), each a runner over its shard of the model and its own
KV cache (this rank's KV heads only, the same block ids on every rank). Step contract: the
scheduler runs on rank 0 only; before each forward `execute` broadcasts what the followers need
(`("forward", input ids, positions, query and context lengths, block tables, logits indices,
sampled rows)`), and `swap` / `offload` / `reload` broadcast their block pairs before copying, so
every rank's cache sees the same copies in the same order. Followers run `follower_loop()`: the
same forward without the LM head or sampling (rank 0 samples) and the same copies, until
`("shutdown",)`, which `close()` sends. A failure during a broadcast or a forward leaves the
ranks' collectives out of step: the group is then broken, the followers are stopped and every
later `execute` raises (restart the engine). TP=1 runs without any of this. CUDA graphs are off
under TP for now (each rank would have to replay its graphs in step).

KV transfer under TP (prefill and decode roles): rank 0 is the worker's one KV endpoint, so the
KV connector and its transport see `transfer_cache`, a cache with every KV head in the model's
layout (the same bytes a TP 1 worker holds), whatever this worker's and its peer's TP degrees.
`gather_kv(layers, block_ids)` fills it from every rank's heads (prefill, before a push) and
`scatter_kv(block_ids)` hands each rank its heads of received blocks (decode, once verified),
both collectives broadcast like the copies above (an 8-bit cache: a rank's share of a block is its
heads' values and scales, `KVQuantFormat.select_heads` / `join_heads`). That cache costs rank 0 one more block of
every head per block id: a block count sized from memory accounts for it, an explicit
`num_blocks` gets it on top. Without TP, `transfer_cache` is `kv_cache` itself and `kv_shards` is
None.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from engine.attention.backend import get_attention_backend
from engine.attention.metadata import AttentionMetadata
from engine.config import HF_QUANT_METHODS, KV_ROLES, EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.huge_pages import place_parameters_in_huge_pages
from engine.kv_cache import KVCache, allocate_kv_cache, bytes_per_block, layer_windows, num_blocks_for_memory
from engine.kv_groups import kv_groups_for
from engine.kv_quant import kv_quant_format
from engine.model.decoder import DecoderForCausalLM, TensorParallelShard, check_tensor_parallel
from engine.model.loader import LoadedModel
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, SamplingMetadata
from engine.step_types import Batch, SampledToken
from engine.speculative import accepted_length

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.parallel import TensorParallelGroup

T = TypeVar("T")
_COPY_CHUNK_BLOCKS = 256  # blocks per copy between the device cache and host slots


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, tp: TensorParallelGroup | None = None) -> None:
        """`tp`: a follower's group (engine/tp_worker.py). Rank 0 passes none and, with
        `config.tensor_parallel_size > 1`, starts its followers here (ValueError first if the
        model cannot be split that way)."""
        self.config = config
        self.arch = loaded.arch
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Triton (the CUDA graphs' capture too) runs on the current device
        self.dtype = config.torch_dtype
        self.tp = tp
        self._followers = None  # rank 0 with TP: engine.tp_worker.Followers
        self._tp_broken: str | None = None
        self._threads_before: int | None = None
        if tp is None and config.tensor_parallel_size > 1:
            check_tensor_parallel(self.arch, config.tensor_parallel_size)
            from engine.tp_worker import start_tensor_parallel
            self.tp, self._followers, threads = start_tensor_parallel(config, loaded.model_dir)
            if self.device.type == "cpu":  # N processes share the cores (restored by close())
                self._threads_before = torch.get_num_threads()
                torch.set_num_threads(threads)
        try:
            self._setup(config, loaded)
        except BaseException:
            self._stop_followers(graceful=False)
            raise

    def _setup(self, config: EngineConfig, loaded: LoadedModel) -> None:
        if self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16):
            from engine import cpu_kernels
            from engine.model import fused_ops
            # bf16 there runs fast only through the native kernels that compute it in fp32
            if not cpu_kernels.native_bf16() and (self.dtype is torch.float16 or not fused_ops.bf16_computed_in_fp32()):
                log.warning("%s on a CPU without AVX512-BF16 or AMX (features: %s) and without pdserve's native "
                            "kernels for it: every matmul converts to float32 and runs slower than --dtype "
                            "float32, the CPU default", str(self.dtype).removeprefix("torch."),
                            " ".join(cpu_kernels.cpu_features()) or "none")
        self.max_model_len = min(config.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.block_size = config.cache.block_size
        self.model = self._build_model(loaded)
        self.kv_format = kv_quant_format(config.cache.kv_cache_dtype, self.block_size,
                                         self.model.shard.num_kv_heads, self.arch.head_dim)
        self.backend = get_attention_backend(config.backend_name, self.kv_format)
        self.kv_groups = kv_groups_for(layer_windows(self.arch), self.arch.num_hidden_layers, config.cache.kv_layout,
                                       self._uniform_layout_needs())
        grouped = self.kv_groups if self.kv_groups.grouped else None
        # Shared memory is for a same-host KV peer, which maps the cache it transfers: under TP
        # that is rank 0's transfer cache, never a rank's own.
        self.kv_cache: KVCache = allocate_kv_cache(self.arch, self._agree_on_num_blocks(), self.block_size,
                                                   self.dtype, self.device,
                                                   shared=config.cache.shared_memory and self.tp is None,
                                                   num_kv_heads=self.model.shard.num_kv_heads,
                                                   kv_format=self.kv_format, groups=grouped)
        self.kv_layers = self.kv_cache.layers
        self.transfer_cache = self.kv_cache
        if self._holds_transfer_cache:
            self.transfer_cache = allocate_kv_cache(self.arch, self.kv_cache.num_blocks, self.block_size, self.dtype,
                                                    self.device, shared=config.cache.shared_memory,
                                                    kv_format=None if self.kv_format is None else
                                                    self.kv_format.with_heads(self.arch.num_key_value_heads))
        self.swap_space = self._allocate_swap_space()
        self.host_cache = self._allocate_host_cache()
        self.sampler = Sampler(seed=config.seed, device=self.device)
        # Decode-only steps replay CUDA graphs (engine/cuda_graphs.py); the Triton backend is the
        # one whose plan can be shared by every batch of a bucket. A prefill worker never decodes;
        # latent attention (torch, planned on the host per batch) is not captured.
        self.decode_graphs: DecodeGraphs | None = None
        if (self.device.type == "cuda" and config.cuda_graphs and self.backend.name == "triton"
                and config.role != "prefill" and self.tp is None and not self.arch.is_mla):
            self.decode_graphs = DecodeGraphs(self.model, self.kv_layers, self.backend, self.block_size,
                                              self.max_model_len, config.scheduler.max_num_seqs,
                                              self.arch.vocab_size, self.device)
            self.decode_graphs.capture_all()
        if self.tp is not None:  # every rank has its KV cache and host slots: the engine may start
            self.tp.all_reduce(torch.zeros(1, device=self.device))

    def _build_model(self, loaded: LoadedModel) -> DecoderForCausalLM:
        # Built on the meta device so no memory is spent on a random init that the weights overwrite.
        with torch.device("meta"):
            model = DecoderForCausalLM(self.arch, self.max_model_len, tp=self.tp).to(self.dtype)
        quantization = self._quantization(loaded)
        placeholders: set[str] = set()
        if quantization in HF_QUANT_METHODS:  # the layers kept as stored get no float memory
            from engine.model.hf_quantized import allocate_all_but_kept
            placeholders = allocate_all_but_kept(model, loaded, self.device)
        else:
            model = model.to_empty(device=self.device)
        if self.device.type == "cpu":
            place_parameters_in_huge_pages(model)  # decode steps stream all weights: fewer TLB misses
        model.init_rotary(self.max_model_len, self.device)  # its tables, computed (not left empty)
        model.load_weights(loaded.iter_weights(placeholders))
        self._keep_quantized(model, loaded, quantization)
        model.prepack_linear_weights()
        return model.eval()

    def _quantization(self, loaded: LoadedModel) -> str:
        """`--quantization` for this checkpoint: `auto` keeps what the hardware serves well, a
        GGUF's blocks on CPU (the native kernels), an fp8 / AWQ / GPTQ checkpoint's tensors on GPUs
        (the Triton kernels), else it dequantizes at load (`none`). ValueError for a format the
        checkpoint does not have."""
        quantization, fmt = self.config.quantization, loaded.quant_format
        if quantization == "auto":
            if loaded.gguf_path is not None and self.device.type == "cpu":
                return "gguf"
            return fmt.method if fmt is not None and self.device.type == "cuda" else "none"
        if quantization == "gguf" and loaded.gguf_path is None:
            raise ValueError(f"quantization 'gguf' keeps a GGUF file's weights as stored, but {loaded.model_dir} "
                             "is a Hugging Face folder: serve the .gguf file (or a packaged model), or use "
                             "quantization 'int8'")
        if quantization in HF_QUANT_METHODS and (fmt is None or fmt.method != quantization):
            found = f"a {fmt.method} checkpoint" if fmt is not None else "not quantized (no quantization_config)"
            raise ValueError(f"quantization {quantization!r} keeps a {quantization} checkpoint's tensors as stored, "
                             f"but {loaded.model_dir} is {found}: use quantization 'auto' or 'none'")
        return quantization

    def _keep_quantized(self, model: DecoderForCausalLM, loaded: LoadedModel, quantization: str) -> None:
        """Which of the checkpoint's weights stay quantized (`_quantization`), in place of the
        loaded model's float layers; under tensor parallelism each rank keeps its part."""
        if quantization == "gguf":
            from engine.model.gguf_quantized import keep_gguf_quantized
            keep_gguf_quantized(model, loaded.gguf_path)
        elif quantization == "int8":
            from engine.model.gguf_quantized import quantize_to_q8_0
            quantize_to_q8_0(model)
        elif quantization in HF_QUANT_METHODS:
            from engine.model.hf_quantized import keep_hf_quantized
            keep_hf_quantized(model, loaded, "triton" if self.config.backend_name == "triton" else "reference",
                              self.device)

    @property
    def _holds_transfer_cache(self) -> bool:
        """Rank 0 of a tensor-parallel prefill or decode worker (see the module docstring)."""
        return self.tp is not None and self.tp.rank == 0 and self.config.role in KV_ROLES

    @property
    def kv_shards(self) -> "ModelRunner | None":
        """What the KV connector calls to move heads between `transfer_cache` and the ranks
        (engine/kv_connector.py `KVShards`); None when `transfer_cache` is `kv_cache`."""
        return self if self._holds_transfer_cache else None

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:  # blocks of every layer: a grouped cache makes as many bytes
            # into blocks of one group's layers (its null block among them)
            if self.kv_groups.grouped:
                return cache.num_blocks * self.arch.num_hidden_layers // self.kv_groups.num_slots
            return cache.num_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.gpu_memory_utilization)
        else:
            budget = int(cache.kv_cache_memory_gb * 2**30)
        heads = self.model.shard.num_kv_heads + (self.arch.num_key_value_heads if self._holds_transfer_cache else 0)
        fmt = None if self.kv_format is None else self.kv_format.with_heads(heads)  # bytes are linear in heads
        return num_blocks_for_memory(self.arch, self.block_size, self.dtype, budget, heads, fmt,
                                     self.kv_groups if self.kv_groups.grouped else None)

    def _uniform_layout_needs(self) -> list[str]:
        """The options of this configuration that need every layer's blocks kept (kv_groups_for)."""
        config = self.config
        needs = [(config.role == "prefill", "role 'prefill' (its sends read one block table for every layer)"),
                 (config.role == "decode" and self.tp is not None, "tensor parallelism on a decode worker"),
                 (config.cache.host_cache_gb > 0 and config.cache.enable_prefix_caching, "host_cache_gb"),
                 (config.scheduler.preemption_mode == "swap", "preemption_mode 'swap'"),
                 (self.device.type == "cuda" and config.cuda_graphs, "CUDA graphs (--no-cuda-graphs lifts it)")]
        return [name for needed, name in needs if needed]

    def _agree_on_num_blocks(self) -> int:
        """This rank's block count; under TP the smallest any rank fits (every rank must have the
        same block ids), which is also the point where every rank has built its model."""
        blocks = self._num_blocks()
        if self.tp is None:
            return blocks
        import torch.distributed as dist
        return int(self.tp.all_reduce(torch.tensor([blocks], device=self.device), dist.ReduceOp.MIN).item())

    @property
    def weight_bytes(self) -> int:
        """This process's weights in memory, pre-blocked copies included (`pdserve status`)."""
        return self.model.weight_bytes

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's vocabulary when the embedding is padded)."""
        return self.arch.vocab_size

    @property
    def num_swap_slots(self) -> int:
        return 0 if self.swap_space is None else int(self.swap_space.shape[1])

    @property
    def num_host_cache_slots(self) -> int:
        return 0 if self.host_cache is None else int(self.host_cache.shape[1])

    def _allocate_swap_space(self) -> torch.Tensor | None:
        """Host slots for swap preemption (see `_host_slots`)."""
        if self.config.scheduler.preemption_mode != "swap":
            return None
        return self._host_slots(self.config.cache.swap_space_gb, "swap_space_gb")

    def _allocate_host_cache(self) -> torch.Tensor | None:
        """Host slots for the prefix cache's host tier (engine/host_cache.py)."""
        if self.config.cache.host_cache_gb <= 0 or not self.config.cache.enable_prefix_caching:
            return None
        return self._host_slots(self.config.cache.host_cache_gb, "host_cache_gb")

    def _host_slots(self, gib: float, option: str) -> torch.Tensor:
        """`[layers, slots, ...]`: each slot one KV block of every layer. Plain host memory, whose
        pages are touched only when first written (torch's pinned allocator would round the size
        up to a power of two); the copies go through bounded temporaries (`_copy_blocks`)."""
        block_bytes = bytes_per_block(self.arch, self.block_size, self.dtype, self.model.shard.num_kv_heads,
                                      self.kv_format)
        slots = int(gib * 2**30) // block_bytes
        if slots < 1:
            raise ValueError(f"{option}={gib} holds no KV block ({block_bytes} bytes each)")
        shape = (self.kv_cache.data.shape[0], slots) + tuple(self.kv_cache.data.shape[2:])
        return torch.empty(shape, dtype=self.kv_cache.data.dtype)  # 8-bit blocks are kept as they are

    def _copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """dst[:, j] = src[:, i] for every (i, j), in order, every layer; between the device cache
        and host slots either way. In chunks, so a copy of thousands of blocks never needs a
        temporary of them all on the device."""
        for start in range(0, len(pairs), _COPY_CHUNK_BLOCKS):
            chunk = pairs[start:start + _COPY_CHUNK_BLOCKS]
            source, target = (torch.tensor(column) for column in zip(*chunk))
            dst[:, target.to(dst.device)] = src[:, source.to(src.device)].to(dst.device)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy blocks to swap slots (block id, slot) and back (slot, block id), every layer.
        Done before a step's forward; the scheduler never puts both kinds in one step."""
        self._to_followers(("swap", swap_out, swap_in))
        self._swap(swap_out, swap_in)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host-cache slots: (block id, slot)."""
        self._to_followers(("offload", pairs))
        self._offload(pairs)

    def reload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host-cache slots back into device blocks: (slot, block id)."""
        self._to_followers(("reload", pairs))
        self._reload(pairs)

    def gather_kv(self, layers: Sequence[int], block_ids: Sequence[int]) -> None:
        """Rank 0 with TP: `transfer_cache[layer][block]` = every rank's heads of it, for each
        given layer and block (before the KV connector pushes them)."""
        self._collective(self._gather_kv, "gather_kv", list(layers), list(block_ids))

    def scatter_kv(self, block_ids: Sequence[int]) -> None:
        """Rank 0 with TP: each rank's cache gets its heads of `transfer_cache`'s blocks, every
        layer (received KV, once verified)."""
        self._collective(self._scatter_kv, "scatter_kv", list(block_ids))

    def _collective(self, run: Callable[..., None], kind: str, *args) -> None:
        """Rank 0 with TP: broadcast (`kind`, *args) to the followers, then take part in
        `run(*args)`, their collectives, with them."""
        self._with_followers((kind, *args), lambda: run(*args))

    def _gather_kv(self, layers: list[int], block_ids: list[int]) -> None:
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer in layers:
            shards = self.tp.gather(self.kv_layers[layer].index_select(0, index))
            if shards is not None:  # rank 0
                parts = [shards[rank] for rank in self._kv_head_owners()]
                fmt = self.transfer_cache.kv_format  # 8-bit: the full-heads format
                heads = torch.cat(parts, dim=3) if fmt is None else fmt.join_heads(parts)
                self.transfer_cache.data[layer].index_copy_(0, index, heads)

    def _scatter_kv(self, block_ids: list[int]) -> None:
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        shape = (len(block_ids), *self.kv_layers[0].shape[1:])  # a rank's blocks
        shards = [TensorParallelShard.of(self.arch, rank, self.tp.world_size) for rank in range(self.tp.world_size)]
        fmt = self.transfer_cache.kv_format  # 8-bit: the full-heads format
        for layer in range(self.arch.num_hidden_layers):
            parts = None
            if self.tp.rank == 0:
                blocks = self.transfer_cache.data[layer].index_select(0, index)
                parts = [blocks[:, :, :, s.kv_head_start:s.kv_head_start + s.num_kv_heads] if fmt is None
                         else fmt.select_heads(blocks, s.kv_head_start, s.num_kv_heads) for s in shards]
            mine = self.tp.scatter(torch.empty(shape, dtype=self.kv_layers[0].dtype, device=self.device), parts)
            self.kv_layers[layer].index_copy_(0, index, mine)

    def _kv_head_owners(self) -> list[int]:
        """One rank per KV head range, in head order (replicated heads: the first rank holding it)."""
        owners: dict[int, int] = {}
        for rank in range(self.tp.world_size):
            owners.setdefault(TensorParallelShard.of(self.arch, rank, self.tp.world_size).kv_head_start, rank)
        return [owners[start] for start in sorted(owners)]

    def _swap(self, swap_out, swap_in) -> None:
        self._copy_blocks(self.kv_cache.data, self.swap_space, swap_out)
        self._copy_blocks(self.swap_space, self.kv_cache.data, swap_in)

    def _offload(self, pairs) -> None:
        self._copy_blocks(self.kv_cache.data, self.host_cache, pairs)

    def _reload(self, pairs) -> None:
        self._copy_blocks(self.host_cache, self.kv_cache.data, pairs)

    # ---- tensor parallelism (rank 0's side, then the followers') ----------------------------

    def _to_followers(self, message: tuple) -> None:
        """Rank 0 with TP: broadcast `message` to the followers; no-op otherwise."""
        if self.tp is None or self.tp.rank != 0:
            return
        if self._tp_broken is not None:
            raise RuntimeError(f"the tensor-parallel group is down ({self._tp_broken}); restart the engine")
        try:
            self.tp.broadcast_object(message)
        except BaseException as exc:
            self._break_group(exc)
            raise

    def _with_followers(self, message: tuple, run: Callable[[], T]) -> T:
        """Rank 0 with TP: broadcast `message`, then `run()` (this rank's part of what the
        followers now do). A failure anywhere between the two (an interrupt included) leaves the
        ranks' collectives out of step, so it breaks the group."""
        if self._tp_broken is not None:
            raise RuntimeError(f"the tensor-parallel group is down ({self._tp_broken}); restart the engine")
        try:
            self.tp.broadcast_object(message)
            return run()
        except BaseException as exc:
            self._break_group(exc)
            raise

    def _break_group(self, exc: BaseException) -> None:
        """The ranks' collectives are out of step: stop the followers for good."""
        log.error("tensor-parallel step failed; stopping the followers: %s: %s", type(exc).__name__, exc)
        self._tp_broken = f"{type(exc).__name__}: {exc}"
        self._stop_followers(graceful=False)

    def _stop_followers(self, graceful: bool) -> None:
        followers, self._followers = self._followers, None
        if followers is None:
            return
        if graceful:
            try:
                self.tp.broadcast_object(("shutdown",))
            except Exception as exc:  # a follower already gone: stop() ends the others
                log.warning("tensor-parallel shutdown message failed: %s", exc)
                graceful = False
        if graceful:
            followers.stop()
        else:
            followers.stop(grace_s=0.0)
        self.tp.close()
        self._tp_broken = self._tp_broken or "closed"
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    @property
    def broken(self) -> str | None:
        """Why this runner cannot run another step (its tensor-parallel group broke, or a follower
        exited, even one that died idle: the next step would fail on it), or None. Any thread may
        read it: a worker's Health does (`AsyncEngine.stats`), so the router stops routing here
        before a request fails on the dead rank."""
        if self._tp_broken not in (None, "closed"):
            return self._tp_broken
        followers = self._followers  # (None once stopped)
        return followers.exited() if followers is not None else None

    def close(self) -> None:
        """Rank 0 with TP: end the followers (shutdown message, then terminate after a grace
        period) and leave the group; idempotent, and a no-op without tensor parallelism."""
        self._stop_followers(graceful=self._tp_broken is None)

    @torch.inference_mode()
    def follower_loop(self) -> None:
        """A follower's life: run what rank 0 broadcasts until `("shutdown",)`."""
        handlers = {"forward": lambda *args: self._forward_eager(*args, compute_logits=False),
                    "swap": self._swap, "offload": self._offload, "reload": self._reload,
                    "gather_kv": self._gather_kv, "scatter_kv": self._scatter_kv}
        while True:
            kind, *args = self.tp.broadcast_object()
            if kind == "shutdown":
                return
            handlers[kind](*args)

    @torch.inference_mode()
    def execute(self, batch: Batch,
                on_layer_stored: Callable[[int], None] | None = None) -> dict[str, list[SampledToken]]:
        """Run the batch's forward and sampling (its swaps, `swap()`, are the caller's, first).
        `on_layer_stored(i)` is called once layer i's K/V of every token is in the cache (the KV
        connector's layer-wise push); such a step runs eagerly. On CUDA it returns once the GPU
        has run the step (the engine times steps: a step that samples nothing would otherwise
        return at launch, and the next one absorb its time)."""
        if not batch.seqs:
            return {}
        if self.device.type == "cuda":
            # Triton launches on the calling thread's current device, not the tensors': the engine
            # thread (or a --device cuda:1 engine) must make this one current.
            torch.cuda.set_device(self.device)
        result = self._execute(batch, on_layer_stored)
        if self.device.type == "cuda" and not result:
            torch.cuda.current_stream(self.device).synchronize()
        return result

    def _execute(self, batch: Batch, on_layer_stored: Callable[[int], None] | None) -> dict[str, list[SampledToken]]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[list[int]]] = []  # per attention row, per KV group
        logits_indices: list[int] = []
        sampled_seqs = []
        sampled_rows: list[int] = []  # their attention rows (indices in query_lens)
        # Per logits row: (seq, j) samples the seq's output position after its first j draft tokens.
        sample_rows: list[tuple[Any, int]] = []
        prompt_rows: list[tuple[Any, int]] = []  # (request, position p): the row predicting prompt token p + 1
        prompt_indices: list[int] = []  # those rows' indices in input_ids
        for seq in batch.seqs:
            end = seq.start + seq.num_new_tokens
            if seq.draft_token_ids:  # one attention row per position, each sampled
                for j, token in enumerate(seq.token_ids):
                    position = seq.start + j
                    input_ids.append(token)
                    positions.append(position)
                    query_lens.append(1)
                    seq_lens.append(position + 1)
                    block_tables.append([table[:position // self.block_size + 1] for table in seq.block_tables])
                    logits_indices.append(len(input_ids) - 1)
                    sampled_rows.append(len(query_lens) - 1)
                    sample_rows.append((seq, j))
                sampled_seqs.append(seq)
                continue
            if seq.request.needs_prompt_logprobs:
                for p in range(seq.start, min(end, seq.request.num_prompt_tokens - 1)):
                    prompt_rows.append((seq.request, p))
                    prompt_indices.append(len(input_ids) + p - seq.start)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start, end))
            query_lens.append(seq.num_new_tokens)
            seq_lens.append(end)
            block_tables.append([table[:(end + self.block_size - 1) // self.block_size] for table in seq.block_tables])
            if seq.sample:
                logits_indices.append(len(input_ids) - 1)
                sampled_seqs.append(seq)
                sampled_rows.append(len(query_lens) - 1)
                sample_rows.append((seq, 0))
        # Rows beyond the sampled ones need the last layer for every token (no row trimming).
        indices, trim_rows = (logits_indices + prompt_indices, None) if prompt_rows else (logits_indices, sampled_rows)
        if self.tp is not None:
            forward = (input_ids, positions, query_lens, seq_lens, block_tables, indices, trim_rows)
            logits = self._with_followers(("forward", *forward), lambda: self._forward_eager(*forward, on_layer_stored))
        elif (on_layer_stored is None and not prompt_rows and self.decode_graphs is not None
                and self.decode_graphs.fits(query_lens, seq_lens)):
            logits = self._decode_with_graph(input_ids, positions, seq_lens, [row[0] for row in block_tables],
                                             logits_indices)
        else:
            logits = self._forward_eager(input_ids, positions, query_lens, seq_lens, block_tables, indices,
                                         trim_rows, on_layer_stored)
        if prompt_rows:
            _record_prompt_logprobs(prompt_rows, logits[len(logits_indices):])
            logits = logits[:len(logits_indices)]
        if not sampled_seqs:
            return {}
        # Row (seq, j) is sampled as the ordinary decode after the draft's first j tokens would be.
        requests = [seq.request for seq, _ in sample_rows]
        outputs = [seq.request.output_token_ids + seq.draft_token_ids[:j] if j else seq.request.output_token_ids
                   for seq, j in sample_rows]
        sampling = SamplingMetadata.build(
            [r.sampling_params for r in requests], [r.prompt_token_ids for r in requests], outputs,
            self.vocab_size, self.device, grammars=[r.grammar for r in requests],
            banned=[_banned_now(r, len(out)) for r, out in zip(requests, outputs)])
        out = self.sampler(logits, sampling)
        tokens = [SampledToken(token_id=out.token_ids[i],
                               logprob=out.logprobs[i] if out.logprobs is not None else None,
                               top_logprobs=out.top_logprobs[i] if out.top_logprobs is not None else None)
                  for i in range(len(sample_rows))]
        result = {}
        row = 0
        for seq in sampled_seqs:
            rows = 1 + len(seq.draft_token_ids)
            keep = accepted_length(seq.draft_token_ids, out.token_ids[row:row + rows]) if rows > 1 else 1
            result[seq.request.request_id] = tokens[row:row + keep]
            row += rows
        return result

    def _forward_eager(self, input_ids, positions, query_lens, seq_lens, block_tables, logits_indices,
                       sampled_rows, on_layer_stored=None, compute_logits: bool = True) -> torch.Tensor | None:
        """`block_tables`: per attention row, its table in each KV group."""
        metas = [AttentionMetadata.build(query_lens, seq_lens, [row[g] for row in block_tables], self.block_size,
                                         self.device) for g in range(self.kv_groups.num_groups)]
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        indices = torch.tensor(logits_indices, dtype=torch.int64, device=self.device)
        logits_metas = None
        if sampled_rows is not None and 0 < len(logits_indices) < len(input_ids):
            # Each sampled token is its sequence's last: the last layer computes only those rows.
            logits_metas = [AttentionMetadata.build([1] * len(sampled_rows), [seq_lens[r] for r in sampled_rows],
                                                    [block_tables[r][g] for r in sampled_rows], self.block_size,
                                                    self.device) for g in range(self.kv_groups.num_groups)]
        meta, logits_meta = self._per_layer(metas), self._per_layer(logits_metas)
        return self.model(ids, pos, self.kv_layers, meta, self.backend, indices, logits_meta, on_layer_stored,
                          compute_logits)

    def _per_layer(self, metas: list[AttentionMetadata] | None) -> AttentionMetadata | list[AttentionMetadata] | None:
        """One group's metadata as it is; several groups' as each layer's (the model takes either)."""
        if metas is None or len(metas) == 1:
            return metas and metas[0]
        return [metas[group] for group in self.kv_groups.layer_group]

    def _decode_with_graph(self, input_ids, positions, seq_lens, block_tables, logits_indices) -> torch.Tensor:
        # One token per sequence, so token i is sequence i and its slot follows from its position.
        slots = [table[p // self.block_size] * self.block_size + p % self.block_size
                 for table, p in zip(block_tables, positions)]
        logits = self.decode_graphs.run(input_ids, positions, slots, seq_lens, block_tables)
        if len(logits_indices) == len(input_ids):
            return logits
        return logits.index_select(0, torch.tensor(logits_indices, dtype=torch.int64, device=self.device))


def _record_prompt_logprobs(rows: list[tuple[Any, int]], logits: torch.Tensor) -> None:
    """Append to each request's `prompt_logprobs` the raw model logprob of prompt token p + 1 at
    row (request, p), with the top `prompt_logprobs` tokens there; positions already recorded (a
    prompt recomputed after preemption) are skipped."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([request.prompt_token_ids[p + 1] for request, p in rows], device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    k = max(request.sampling_params.prompt_logprobs for request, _ in rows)
    top_values, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))  # k = 0: empty rows
    for i, (request, p) in enumerate(rows):
        if len(request.prompt_logprobs) != p + 1:
            continue
        want = request.sampling_params.prompt_logprobs
        top = list(zip(top_ids[i][:want], top_values[i][:want]))
        request.prompt_logprobs.append(TokenLogprob(request.prompt_token_ids[p + 1], chosen[i], top))


def _banned_now(request, num_outputs: int) -> list[int]:
    """The tokens `request` may not sample after `num_outputs` outputs: its EOS and stop token ids
    until it has `min_tokens` (resumed tokens count: they are outputs)."""
    params = request.sampling_params
    if num_outputs >= params.min_tokens:
        return []
    return sorted(set(request.eos_token_ids) | set(params.stop_token_ids))
