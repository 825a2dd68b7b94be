"""Tiny random Llama/Mistral/Qwen2 checkpoints: our paged model must reproduce transformers' logits
and greedy tokens, through a real paged KV cache."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

from pagedserve.config import ModelConfig
from pagedserve.kernels import load_cpu_kernels
from pagedserve.models.attention import build_attention_metadata
from pagedserve.models.loader import LoadedModel, load_model
from pagedserve.models.registry import MODEL_REGISTRY, ModelLoadError
from pagedserve.tokenizer import load_tokenizer, request_eos_token_ids, tokenizer_path
from pagedserve.worker.cpu_fast_paths import can_pack_linear_weights, pack_linear_weights, use_fused_ops
from tests.utils import TINY_CONFIG

BLOCK_SIZE = 4
NUM_BLOCKS = 64
TINY = dict(TINY_CONFIG, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]),
    "llama3-rope": lambda: LlamaConfig(
        **TINY,
        architectures=["LlamaForCausalLM"],
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-linear-tied-bias-headdim": lambda: LlamaConfig(
        **TINY,
        architectures=["LlamaForCausalLM"],
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        head_dim=32,
    ),
    "mistral": lambda: MistralConfig(**TINY, architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": lambda: Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
}
PROMPT = [3, 17, 42, 99, 5, 64, 7, 120, 33, 8, 91, 12, 54]
PROMPT_2 = [11, 22, 33, 44, 55, 66]


def save_tiny_tokenizer(path: str) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(path)


def build_hf_model(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    """A random model whose logits have clear gaps (HF's std=0.02 init makes greedy argmax ties likely)."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = getattr(transformers, config.architectures[0])(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif param.dim() == 1:
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]) if "embed" not in name else 1.0)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_dir(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel]:
    """A tiny random model of each family saved as a Hugging Face directory with a tokenizer."""
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model = build_hf_model(CONFIGS[request.param]())
    hf_model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path)
    return path, hf_model


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> tuple[transformers.PreTrainedModel, LoadedModel]:
    path, hf_model = tiny_dir
    return hf_model, load_model(ModelConfig(model=path, dtype="float32"), torch.device("cpu"))


def new_kv_caches(loaded: LoadedModel) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, loaded.num_kv_heads, loaded.head_dim)
    return [torch.zeros(shape, dtype=loaded.dtype) for _ in range(loaded.num_layers)]


def block_table(first_block: int, num_tokens: int) -> list[int]:
    """Scattered, descending block ids so that reading through the table really matters."""
    num_blocks = (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    return [first_block - 2 * i for i in range(num_blocks)]


@torch.inference_mode()
def run_step(loaded, kv_caches, token_ids, num_computed, num_new, tables) -> torch.Tensor:
    """One forward over several requests (decodes first); returns logits ``[num_tokens, vocab]``."""
    meta = build_attention_metadata(num_computed, num_new, tables, BLOCK_SIZE)
    positions = torch.tensor([p for c, n in zip(num_computed, num_new) for p in range(c, c + n)])
    hidden = loaded.model(torch.tensor(token_ids), positions, kv_caches, meta)  # [num_tokens, hidden]
    return loaded.model.compute_logits(hidden).float()


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(hf_model, prompt: list[int], num_steps: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_registry_covers_the_family():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(MODEL_REGISTRY)


def test_loaded_fields(tiny, tiny_dir):
    hf_model, loaded = tiny
    config = hf_model.config
    assert loaded.num_layers == 2 and loaded.num_kv_heads == 2 and loaded.vocab_size == 128
    assert loaded.head_dim == (getattr(config, "head_dim", None) or 16)
    assert loaded.dtype == torch.float32 and not loaded.model.training
    assert loaded.max_model_len == 256
    # the config names no EOS: the served one is the tokenizer's, which the front end adds to each request
    assert not hasattr(loaded, "tokenizer")  # token ids only: front ends load it (pagedserve.tokenizer)
    tokenizer = load_tokenizer(tokenizer_path(ModelConfig(model=tiny_dir[0])))
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert request_eos_token_ids(loaded.eos_token_ids, tokenizer) == (2,)
    assert loaded.model_name.startswith(config.model_type) or loaded.model_name.startswith("llama")
    if config.tie_word_embeddings:
        assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_prefill_logits_match_transformers(tiny):
    hf_model, loaded = tiny
    logits = run_step(loaded, new_kv_caches(loaded), PROMPT, [0], [len(PROMPT)], [block_table(40, len(PROMPT))])
    torch.testing.assert_close(logits, hf_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_matches_single_chunk(tiny):
    _, loaded = tiny
    table = block_table(40, len(PROMPT))
    whole = run_step(loaded, new_kv_caches(loaded), PROMPT, [0], [len(PROMPT)], [table])
    kv_caches = new_kv_caches(loaded)
    split = 5  # inside a block
    first = run_step(loaded, kv_caches, PROMPT[:split], [0], [split], [table])
    second = run_step(loaded, kv_caches, PROMPT[split:], [split], [len(PROMPT) - split], [table])
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-4, rtol=1e-4)


def test_greedy_decode_matches_generate(tiny):
    """Two requests prefilled in one batch, then decoded together one token at a time through the cache."""
    hf_model, loaded = tiny
    num_steps = 10
    prompts = [PROMPT, PROMPT_2]
    tables = [block_table(60, len(PROMPT) + num_steps), block_table(59, len(PROMPT_2) + num_steps)]
    kv_caches = new_kv_caches(loaded)
    logits = run_step(loaded, kv_caches, PROMPT + PROMPT_2, [0, 0], [len(PROMPT), len(PROMPT_2)], tables)
    last = [len(PROMPT) - 1, len(PROMPT) + len(PROMPT_2) - 1]
    next_ids = logits[last].argmax(-1).tolist()
    generated = [[next_ids[0]], [next_ids[1]]]
    lengths = [len(PROMPT), len(PROMPT_2)]
    for _ in range(num_steps - 1):
        logits = run_step(loaded, kv_caches, next_ids, lengths, [1, 1], tables)
        lengths = [n + 1 for n in lengths]
        next_ids = logits.argmax(-1).tolist()
        for out, token_id in zip(generated, next_ids):
            out.append(token_id)
    for prompt, out in zip(prompts, generated):
        assert out == hf_greedy(hf_model, prompt, num_steps)


def test_bfloat16_load_stays_close(tiny, tmp_path):
    hf_model, _ = tiny
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    save_tiny_tokenizer(str(tmp_path))
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16"), "cpu")
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = run_step(loaded, new_kv_caches(loaded), PROMPT, [0], [len(PROMPT)], [block_table(40, len(PROMPT))])
    assert logits.dtype == torch.float32
    reference = hf_logits(hf_model, PROMPT)
    assert (logits - reference).abs().max() < 0.15 * reference.abs().max()


def load_bf16(hf_model, path) -> LoadedModel:
    """The tiny model saved to ``path`` and loaded back in bfloat16."""
    hf_model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(str(path))
    return load_model(ModelConfig(model=str(path), dtype="bfloat16"), "cpu")


def two_prompt_step(loaded: LoadedModel) -> torch.Tensor:
    """Logits of one step prefilling PROMPT and PROMPT_2 together, on fresh caches."""
    tables = [block_table(40, len(PROMPT)), block_table(59, len(PROMPT_2) + 1)]
    return run_step(loaded, new_kv_caches(loaded), PROMPT + PROMPT_2, [0, 0], [len(PROMPT), len(PROMPT_2)], tables)


def test_cpu_fast_paths_give_identical_logits(tiny, tmp_path):
    """oneDNN-packed bf16 weights give bit-identical logits, the fused C++ ops too up to a bf16 rounding;
    plain weight copies are released except a tied embedding's."""
    if not can_pack_linear_weights(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU's oneDNN has no native bf16")
    loaded = load_bf16(tiny[0], tmp_path)
    plain = two_prompt_step(loaded)
    model = loaded.model
    assert pack_linear_weights(model, batch_size_hint=8) == 4 * loaded.num_layers + 1
    packed = two_prompt_step(loaded)
    torch.testing.assert_close(packed, plain, atol=0, rtol=0)
    kernels = load_cpu_kernels()
    if kernels is not None and use_fused_ops(model, kernels):  # rope, norms and SiLU-and-mul in C++ as well
        assert model.model.layers[0].self_attn.fused_ops is kernels and model.model.norm.fused_ops is kernels
        fused = two_prompt_step(loaded)
        # identical here; elsewhere a float32 summation order or exp may flip one bf16 rounding
        torch.testing.assert_close(fused, plain, atol=0.05, rtol=0.02)
        assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() > 0.9
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0  # released
    assert model.model.embed_tokens.weight.numel() == loaded.vocab_size * model.config.hidden_size
    with pytest.raises(RuntimeError, match="pack_weight"):
        model.lm_head.weight_loader(model.lm_head.weight, model.lm_head.weight.detach().clone())


def test_float32_packed_weights_match_the_plain_model(tiny, tmp_path):
    """float32 models get oneDNN-packed weights too (no AMX copy, no bf16 fused ops): the logits equal
    the plain float32 model's and Transformers' up to summation order, and greedy picks agree."""
    if not can_pack_linear_weights(torch.device("cpu"), torch.float32):
        pytest.skip("PyTorch was built without oneDNN")
    hf_model, _ = tiny
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    save_tiny_tokenizer(str(tmp_path))
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), "cpu")
    plain = two_prompt_step(loaded)
    kernels = load_cpu_kernels()
    assert pack_linear_weights(loaded.model, batch_size_hint=8, kernels=kernels) == 4 * loaded.num_layers + 1
    layers = [m for m in loaded.model.modules() if getattr(m, "packed_weight", None) is not None]
    assert len(layers) == 4 * loaded.num_layers + 1
    assert all(m.packed_weight.dtype == torch.float32 and m.amx_weight is None for m in layers)
    packed = two_prompt_step(loaded)
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))
    reference = hf_logits(hf_model, PROMPT)
    torch.testing.assert_close(packed[: len(PROMPT)], reference, atol=1e-4, rtol=1e-4)


def test_amx_matmuls_give_the_same_logits(tiny, tmp_path):
    """With the C++ kernels on an AMX CPU every linear of the tiny model takes the AMX layout too,
    and the logits of a two-prompt prefill step stay those of the plain bf16 model."""
    kernels = load_cpu_kernels()
    if (
        kernels is None
        or not kernels.has_amx_linear()
        or not can_pack_linear_weights(torch.device("cpu"), torch.bfloat16)
    ):
        pytest.skip("no AMX bf16 tiles on this machine (or no compiler)")
    loaded = load_bf16(tiny[0], tmp_path)
    plain = two_prompt_step(loaded)
    assert pack_linear_weights(loaded.model, batch_size_hint=8, kernels=kernels) == 4 * loaded.num_layers + 1
    assert (
        loaded.model.lm_head.amx_weight is not None
        and loaded.model.model.layers[0].mlp.down_proj.amx_weight is not None
    )
    amx_weights = [
        module.amx_weight for module in loaded.model.modules() if getattr(module, "amx_weight", None) is not None
    ]
    buffers = {weight.untyped_storage().data_ptr() for weight in amx_weights}
    assert (
        len(amx_weights) == 4 * loaded.num_layers + 1 and len(buffers) == 1
    )  # one buffer, on huge pages where allowed
    amx = two_prompt_step(loaded)
    torch.testing.assert_close(amx, plain, atol=0.05, rtol=0.02)
    assert (amx.argmax(-1) == plain.argmax(-1)).float().mean() > 0.9


def test_avx512_bf16_matmuls_give_the_same_logits(tiny, tmp_path):
    """With the C++ kernels built with AVX512-BF16 on a CPU without AMX, every linear of the tiny
    model takes that matmul's layout in place of oneDNN's (one buffer, on huge pages where allowed),
    and the logits of a two-prompt prefill step stay those of the plain bf16 model."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.has_avx512_bf16_linear() or kernels.has_amx_linear():
        pytest.skip("needs the C++ kernels built with AVX512-BF16 on a CPU without AMX")
    loaded = load_bf16(tiny[0], tmp_path)
    plain = two_prompt_step(loaded)
    assert pack_linear_weights(loaded.model, batch_size_hint=8, kernels=kernels) == 4 * loaded.num_layers + 1
    layers = [m for m in loaded.model.modules() if getattr(m, "vnni_weight", None) is not None]
    assert len(layers) == 4 * loaded.num_layers + 1 and all(m.packed_weight is None for m in layers)
    assert len({m.vnni_weight.untyped_storage().data_ptr() for m in layers}) == 1
    out = two_prompt_step(loaded)
    torch.testing.assert_close(out, plain, atol=0.05, rtol=0.02)
    assert (out.argmax(-1) == plain.argmax(-1)).float().mean() > 0.9


def test_eos_ids_and_generation_config(tmp_path):
    config = CONFIGS["llama"]()
    config.eos_token_id = [2, 7]
    build_hf_model(config).save_pretrained(tmp_path, safe_serialization=True)
    save_tiny_tokenizer(str(tmp_path))
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [9, 2], "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.57"}, f)
    loaded = load_model(
        ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=100, served_model_name="tiny"), "cpu"
    )
    assert loaded.eos_token_ids == (2, 7, 9)
    assert loaded.generation_config == {"eos_token_id": [9, 2], "temperature": 0.6, "top_p": 0.9}
    assert loaded.max_model_len == 100 and loaded.model_name == "tiny"
    with pytest.raises(ModelLoadError, match="exceeds"):
        load_model(ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=1000), "cpu")


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    build_hf_model(CONFIGS["llama"]()).save_pretrained(tmp_path, safe_serialization=True)
    save_tiny_tokenizer(str(tmp_path))
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"k_proj|qkv_proj"):
        load_model(ModelConfig(model=str(tmp_path), dtype="float32"), "cpu")


def test_unsupported_architecture(tmp_path):
    config = CONFIGS["llama"]()
    build_hf_model(config).save_pretrained(tmp_path, safe_serialization=True)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    raw["architectures"] = ["GPTNeoXForCausalLM"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ModelLoadError, match="unsupported model architecture"):
        load_model(ModelConfig(model=os.fspath(tmp_path), dtype="float32"), "cpu")


def test_mistral_sliding_window_caps_max_model_len(tmp_path):
    config = CONFIGS["mistral"]()
    config.sliding_window = 64
    build_hf_model(config).save_pretrained(tmp_path, safe_serialization=True)
    save_tiny_tokenizer(str(tmp_path))
    assert load_model(ModelConfig(model=str(tmp_path), dtype="float32"), "cpu").max_model_len == 64
    with pytest.raises(ModelLoadError, match="exceeds"):
        load_model(ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=65), "cpu")
