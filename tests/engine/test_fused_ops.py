"""The fused elementwise kernels (engine/csrc/fused_ops_cpu.cpp), bf16 and float32, against the torch
expressions they replace, op by op and through a whole model, and the float32 small-batch linear
kernel against F.linear."""
import importlib.util
import shutil

import pytest
import torch
import transformers
from torch.nn import functional as F

from engine import cpu_kernels
from engine.attention.backend import get_attention_backend
from engine.model import fused_ops
from engine.model.decoder import DecoderForCausalLM
from engine.model.loader import resolve_model
from engine.model.rope import RotaryEmbedding
from tests.engine.paged_harness import greedy_generate_paged

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def native():
    """The kernels module; it must have built wherever a C++ compiler exists (as in CI)."""
    module = fused_ops._kernels()
    if module is None:
        if shutil.which("c++") and importlib.util.find_spec("ninja") and _simd_cpu():
            pytest.fail("the fused CPU ops did not build although a compiler and AVX2 + FMA are present")
        pytest.skip("no compiler or no AVX2 + FMA: the model keeps the torch expressions")
    return module


def _simd_cpu() -> bool:
    features = set(cpu_kernels.cpu_features())
    return "avx512f" in features or {"avx2", "fma", "f16c"} <= features


def _torch_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 values equal, or one bf16 step apart (a sum or exp evaluated in another order).

    The contract on special values is torch's, exactly: NaN where torch has NaN, and the same sign
    everywhere, zeros included (silu of a large negative gate times a positive `up` is -0.0 in torch,
    so +0.0 is a difference, named as such rather than as 32768 ulps)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN where torch has none, or a number where torch has NaN"
    got, want = got[~nan], want[~nan]
    sign = got.signbit() != want.signbit()
    assert not bool(sign.any()), f"sign differs from torch's (signed zeros count): {got[sign][:4]} vs {want[sign][:4]}"
    got_bits = got.view(torch.int16).to(torch.int32)
    want_bits = want.view(torch.int16).to(torch.int32)
    assert got_bits.numel() == 0 or int((got_bits - want_bits).abs().max()) <= 1, "more than one bf16 ulp apart"


@pytest.mark.parametrize("hidden", [576, 72, 5])  # a multiple of 16, a 16-lane tail, shorter than a vector
def test_rms_norm_and_add_rms_norm_match_torch(native, hidden):
    torch.manual_seed(hidden)
    x = (torch.randn(37, hidden) * 3).to(BF16)
    weight = (torch.rand(hidden) + 0.5).to(BF16)
    _within_one_ulp(native.rms_norm(x, weight, 1e-5), _torch_rms_norm(x, weight, 1e-5))
    # rows that are a strided view (e.g. a slice of a wider buffer) are read in place
    wide = torch.randn(37, hidden + 9).to(BF16)
    view = wide[:, 3:3 + hidden]
    _within_one_ulp(native.rms_norm(view, weight, 1e-6), _torch_rms_norm(view, weight, 1e-6))

    residual = torch.randn(37, hidden).to(BF16)
    expected_sum = residual + x
    normed = native.add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_sum), "the residual add must round exactly like torch's bf16 add"
    _within_one_ulp(normed, _torch_rms_norm(expected_sum, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rms_norm_of_special_values_matches_torch(native, dtype):
    """Signed zeros keep their sign (a -0 input times a positive weight is -0, times a negative one
    +0), an infinity or NaN in a row makes that row NaN, as in torch's expression."""
    rows = torch.zeros(4, 40)
    rows[0, ::3] = -0.0
    rows[0, 1::3] = torch.randn(13)
    rows[1] = -0.0
    rows[2, 5], rows[3, 7] = float("inf"), float("nan")
    weight = (torch.rand(40) + 0.5) * torch.where(torch.rand(40) < 0.5, -1.0, 1.0)
    x, w = rows.to(dtype), weight.to(dtype)
    got, want = native.rms_norm(x, w, 1e-5), _torch_rms_norm(x, w, 1e-5)
    if dtype == BF16:
        _within_one_ulp(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=3e-7, atol=0, equal_nan=True)
        finite = ~want.isnan()
        assert torch.equal(got[finite].signbit(), want[finite].signbit()), "signed zeros must match torch's"


@pytest.mark.parametrize("inter", [1536, 40, 7])
def test_silu_and_mul_matches_torch(native, inter):
    torch.manual_seed(inter)
    gate_up = (torch.randn(19, 2 * inter) * 4).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    got = native.silu_and_mul(gate_up)
    assert got.shape == (19, inter)
    _within_one_ulp(got, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_silu_and_mul_of_large_gates_matches_torch(native, dtype):
    """Gates far from 0 (exp(-g) overflows float32 below about -88.7): silu -> -0 there, like torch,
    not g or garbage (AVX2's exp once built 2^n past the exponent bits; AVX-512's, unclamped above,
    gave +0 for -1e30). Infinities and NaN as torch: silu(-inf) and silu(NaN) are NaN, silu(inf) inf."""
    gate = torch.cat([torch.arange(-400, -80, 0.25), torch.arange(80, 400, 0.25),
                      torch.tensor([-88.75, -88.5, -88.25, -87.0, 88.25, 88.5, 88.75, -1e30, 1e30, -3e38, 3e38,
                                    float("-inf"), float("inf"), float("nan"), 0.0, -0.0]),
                      torch.randn(301) * 4])
    torch.manual_seed(5)
    up = (torch.rand(gate.numel()) + 0.5) * torch.where(torch.rand(gate.numel()) < 0.5, -1.0, 1.0)
    gate_up = torch.stack([gate, up]).to(dtype).view(2, 1, -1).expand(2, 3, -1).permute(1, 0, 2).reshape(3, -1)
    g, u = gate_up.chunk(2, dim=-1)
    got = native.silu_and_mul(gate_up)
    want = F.silu(g) * u
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == BF16:
        _within_one_ulp(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-30, equal_nan=True)
        finite = ~want.isnan()
        assert torch.equal(got[finite].signbit(), want[finite].signbit()), "signed zeros must match torch's"


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 1), (32, 2, 2)])
def test_rotary_embedding_is_bit_identical_to_torch(native, head_dim, heads, kv_heads):
    torch.manual_seed(head_dim)
    tokens = 29
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None)
    # query and key as strided views of one fused qkv output, as the model passes them
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(BF16)
    query = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 2048, (tokens,))
    got_q, got_k = native.rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache)
    cos = rope.cos_cache.index_select(0, positions).to(BF16)[:, None, :]
    sin = rope.sin_cache.index_select(0, positions).to(BF16)[:, None, :]
    assert torch.equal(got_q, query * cos + fused_ops._rotate_half(query) * sin)
    assert torch.equal(got_k, key * cos + fused_ops._rotate_half(key) * sin)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.rotary_embedding(torch.tensor([2048] * tokens), query, key, rope.cos_cache, rope.sin_cache)


def test_rotary_embedding_rounds_edge_values_like_torch(native):
    """The bf16 conversion takes a one-instruction path that reads denormals as zero and keeps NaN
    payloads; vectors holding those lanes must still round exactly as torch does."""
    torch.manual_seed(5)
    tokens, heads, kv_heads, head_dim = 11, 4, 2, 64
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None)
    query = torch.randn(tokens, heads, head_dim)
    key = torch.randn(tokens, kv_heads, head_dim)
    specials = torch.tensor([1e-39, -3e-40, 2e-38, -1.5e-38, 3e38, -3e38, float("inf"), float("-inf"), 0.0, -0.0])
    query.view(-1)[torch.randperm(query.numel())[:200]] = specials.repeat(20)
    key.view(-1)[torch.randperm(key.numel())[:50]] = specials.repeat(5)
    query[2, 1] = 1e-39 * torch.randn(head_dim)  # whole heads of denormals: denormal outputs
    query[4, 0] = 2e-38 * torch.randn(head_dim)
    key[3, 1, 7] = float("nan")
    query, key = query.to(BF16), key.to(BF16)
    positions = torch.randint(0, 2048, (tokens,))
    got_q, got_k = native.rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache)
    cos = rope.cos_cache.index_select(0, positions).to(BF16)[:, None, :]
    sin = rope.sin_cache.index_select(0, positions).to(BF16)[:, None, :]
    want_q = query * cos + fused_ops._rotate_half(query) * sin
    want_k = key * cos + fused_ops._rotate_half(key) * sin
    assert torch.equal(got_q.view(torch.int16), want_q.view(torch.int16))
    denormal_out = (want_q != 0) & (want_q.abs() < torch.finfo(torch.float32).tiny)
    assert bool(denormal_out.any()), "the edge values must produce denormal results"
    nan = want_k.isnan()
    assert torch.equal(got_k.isnan(), nan) and bool(nan.any())
    assert torch.equal(got_k[~nan].view(torch.int16), want_k[~nan].view(torch.int16))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 32, 128, 130])
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (37, 64, True), (16, 1536, False),
                                                         (52, 96, True)])
def test_small_batch_linear_matches_f_linear(native, rows, out_features, in_features, bias):
    assert native.has_small_linear()  # vdpbf16ps with AVX512-BF16, else fp32 compute
    torch.manual_seed(rows + out_features)
    wide = torch.randn(rows, in_features + 32).to(BF16)
    x = wide[:, 16:16 + in_features]  # rows read in place from a strided view
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).to(BF16)
    b = torch.randn(out_features).to(BF16) if bias else None
    got = native.small_batch_linear(x, weight, b)
    assert got.shape == (rows, out_features) and got.dtype == BF16
    # fp32 sums in another order than oneDNN's: equal up to bf16 rounding of the result
    torch.testing.assert_close(got.float(), F.linear(x, weight, b).float(), atol=1e-2, rtol=1e-2)
    if rows > 1:  # each row is its own product: its bits do not depend on the group it lands in
        for row in range(rows):
            pair = torch.stack([x[row], x[row]])
            assert torch.equal(native.small_batch_linear(pair, weight, b)[1], got[row])
    if rows <= fused_ops.small_linear_max_rows():
        assert torch.equal(fused_ops.linear(x, weight, b), got)


def test_linear_takes_f_linear_outside_the_small_bf16_case(native):
    weight = torch.randn(48, 64).to(BF16)
    x = torch.randn(2, 48).to(BF16)  # K not a multiple of 32
    w48 = torch.randn(48, 48).to(BF16)
    assert torch.equal(fused_ops.linear(x, w48), F.linear(x, w48))
    with pytest.raises(RuntimeError, match="1 to 256 rows"):
        native.small_batch_linear(torch.randn(257, 64).to(BF16), weight)


@pytest.mark.parametrize("rows", [fused_ops.SMALL_LINEAR_MAX_ROWS_AMX + 1, fused_ops.SMALL_LINEAR_MAX_ROWS + 1,
                                  fused_ops.BF16_WIDENED_KERNEL_MAX_ROWS + 1])
def test_bf16_linear_above_a_decode_step(native, rows):
    """With AVX512-BF16, oneDNN (on the pre-blocked weight where given); without it, never oneDNN's
    bf16 GEMM (several times slower than fp32 there): the kernel up to its limit, then fp32 sgemm."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 576).to(BF16)
    weight, bias = (torch.randn(200, 576) / 24).to(BF16), torch.randn(200).to(BF16)
    got = fused_ops.linear(x, weight, bias, packed=fused_ops.prepack_linear_weight(weight))
    if native.small_linear_bf16_dot():
        want = F.linear(x, weight, bias)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    elif rows <= fused_ops.BF16_WIDENED_KERNEL_MAX_ROWS:
        assert fused_ops.prepack_linear_weight(weight) is None  # no second copy of weights it never reads
        assert torch.equal(got, native.small_batch_linear(x, weight, bias))
    else:
        assert torch.equal(got, F.linear(x.float(), weight.float(), bias.float()).to(BF16))


@pytest.fixture(scope="module")
def library():
    """The kernels module on any CPU (the fp32 small-batch linear needs AVX2 + FMA or AVX-512)."""
    module = fused_ops._library()
    if module is None:
        if shutil.which("c++") and importlib.util.find_spec("ninja"):
            pytest.fail("the CPU kernels did not build although a compiler is present")
        pytest.skip("no compiler: linear layers stay on F.linear")
    if not module.has_small_linear_f32():
        pytest.skip("no AVX2 + FMA: float32 linear layers stay on F.linear")
    return module


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 64, 65])
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (37, 64, True), (3, 1536, False),
                                                         (50, 96, True)])
def test_small_batch_linear_f32_matches_f_linear(library, rows, out_features, in_features, bias):
    torch.manual_seed(rows + out_features)
    wide = torch.randn(rows, in_features + 32)
    x = wide[:, 16:16 + in_features]  # rows read in place from a strided view
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    b = torch.randn(out_features) if bias else None
    got = library.small_batch_linear_f32(x, weight, b)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)  # another summation order
    for row in (0, rows - 1):  # a row's bits do not depend on the group of rows it is computed with
        assert torch.equal(library.small_batch_linear_f32(x[row:row + 1], weight, b)[0], got[row])
    if rows <= fused_ops.SMALL_LINEAR_F32_MAX_ROWS:
        assert torch.equal(fused_ops.linear(x, weight, b), got)
    else:
        assert torch.equal(fused_ops.linear(x, weight, b), F.linear(x, weight, b))


@pytest.mark.parametrize("rows", [1, fused_ops.PACKED_F32_MIN_ROWS - 1, fused_ops.PACKED_F32_MIN_ROWS, 64, 300])
def test_float32_linear_with_a_pre_blocked_weight(library, rows):
    """With oneDNN's blocked copy: the native kernel below PACKED_F32_MIN_ROWS rows (bit for bit),
    oneDNN from there, within float32 summation-order noise of F.linear either way."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 576)
    weight, bias = torch.randn(200, 576) / 24, torch.randn(200)
    packed = fused_ops.prepack_linear_weight(weight)
    if packed is None:
        pytest.skip("torch built without oneDNN: float32 linear layers keep one copy of their weights")
    assert packed.shape == weight.shape
    got = fused_ops.linear(x, weight, bias, packed=packed)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    if rows < fused_ops.PACKED_F32_MIN_ROWS:
        assert torch.equal(got, library.small_batch_linear_f32(x, weight, bias))
    else:
        assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))


def test_float32_linear_takes_f_linear_where_the_kernel_does_not_apply(library):
    weight = torch.randn(40, 56)
    x = torch.randn(2, 56)  # K not a multiple of 16
    assert torch.equal(fused_ops.linear(x, weight), F.linear(x, weight))
    with pytest.raises(RuntimeError, match="1 to 256 rows"):
        library.small_batch_linear_f32(torch.randn(257, 64), torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="float32"):
        library.small_batch_linear_f32(torch.randn(2, 64).to(BF16), torch.randn(8, 64))


def _within_float32_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """float32 values at most `ulps` steps apart (same sign: compare the bit patterns as integers)."""
    assert got.dtype is want.dtype is torch.float32 and bool((got.sign() * want.sign() >= 0).all())
    diff = (got.view(torch.int32).to(torch.int64) - want.view(torch.int32).to(torch.int64)).abs()
    assert int(diff.max()) <= ulps, f"{int(diff.max())} float32 ulps apart"


def test_float32_takes_the_fused_ops_within_a_few_ulps_of_torch(native):
    """float32 activations take the same kernels: RoPE and the SiLU product bit-identical to the
    torch expressions (no product fused into a sum), RMSNorm and SiLU's exp within a few ulps."""
    torch.manual_seed(3)
    assert fused_ops.native_for(torch.randn(4, 64)) is native and fused_ops.native_for(torch.randn(4, 64).half()) is None
    for hidden in (576, 72, 5):
        x = torch.randn(21, hidden) * 3
        weight = torch.rand(hidden) + 0.5
        _within_float32_ulps(fused_ops.rms_norm(x, weight, 1e-5), _torch_rms_norm(x, weight, 1e-5), 4)
        residual = torch.randn(21, hidden)
        expected = residual + x
        normed = fused_ops.add_rms_norm_(x, residual, weight, 1e-5)
        assert torch.equal(residual, expected)
        _within_float32_ulps(normed, _torch_rms_norm(expected, weight, 1e-5), 4)
    gate_up = torch.randn(19, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=3e-7, atol=1e-30)
    rope = RotaryEmbedding(64, 2048, 10000.0, None)
    qkv = torch.randn(29, 15 * 64)
    query, key = qkv[:, :9 * 64].view(29, 9, 64), qkv[:, 9 * 64:12 * 64].view(29, 3, 64)
    positions = torch.randint(0, 2048, (29,))
    got_q, got_k = fused_ops.rotary(positions, query, key, rope.cos_cache, rope.sin_cache)
    cos = rope.cos_cache.index_select(0, positions)[:, None, :]
    sin = rope.sin_cache.index_select(0, positions)[:, None, :]
    assert torch.equal(got_q, query * cos + fused_ops._rotate_half(query) * sin)
    assert torch.equal(got_k, key * cos + fused_ops._rotate_half(key) * sin)
    with pytest.raises(RuntimeError, match="both be bf16 or both float32"):
        native.rotary_embedding(positions, query, key.to(BF16), rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="in the activation's dtype"):
        native.rms_norm(x, weight.to(BF16), 1e-5)


def test_a_bf16_model_gives_the_same_tokens_with_and_without_the_fused_ops(native, tmp_path, monkeypatch):
    """Whole model, bf16, paged cache, prefill then decode: logits within bf16 noise of the torch
    expressions and F.linear, and the same greedy tokens."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=160, intermediate_size=200, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = resolve_model(str(tmp_path))
    model = DecoderForCausalLM(loaded.arch)
    model.load_weights(loaded.iter_weights())
    model = model.to(BF16).eval()
    model.rotary = RotaryEmbedding(32, 256, loaded.arch.rope_theta, loaded.arch.rope_scaling)  # fp32 tables
    prompts = [[5, 17, 99, 3, 200, 11], [42] * 23, list(range(1, 40))]
    backend = get_attention_backend("torch")

    calls = {"rms_norm": 0, "add_rms_norm_": 0, "silu_and_mul": 0, "rotary_embedding": 0,
             "small_batch_linear": 0}  # decode steps of 3 tokens

    class Counting:
        def __getattr__(self, name):
            if name in calls:
                calls[name] += 1
            return getattr(native, name)

    monkeypatch.setattr(fused_ops, "_kernels", lambda: Counting())
    fused_tokens, fused_logits = greedy_generate_paged(model, backend, prompts, 8, block_size=4, dtype=BF16,
                                                       return_first_logits=True)
    assert all(count > 0 for count in calls.values()), calls
    monkeypatch.setattr(fused_ops, "_kernels", lambda: None)
    torch_tokens, torch_logits = greedy_generate_paged(model, backend, prompts, 8, block_size=4, dtype=BF16,
                                                       return_first_logits=True)
    torch.testing.assert_close(fused_logits, torch_logits, atol=0.05, rtol=0.02)
    assert fused_tokens == torch_tokens
