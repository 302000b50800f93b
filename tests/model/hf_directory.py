"""A tiny randomly initialized DeepSeek-V3 directory written by transformers' ``save_pretrained``: config.json with
DeepSeek-V3's YaRN scaling and interleaved RoPE, bfloat16 safetensors, a word-level tokenizer.json and a chat
template — what ``kvpool up --model-dir`` serves and transformers loads beside it. Dense by default; with ``moe``
its layers from ``first_k_dense_replace`` on are DeepSeek-V3's MoE, and ``quantize_fp8`` rewrites a directory's
weights as DeepSeek-V3 ships them (FP8 e4m3, block scales in ``*_scale_inv``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from kvpool.model.weight_names import is_quantizable

if TYPE_CHECKING:  # imported where used: importing it scans its whole package, ~1 s of every test worker's collection
    import transformers

NUM_WORDS = 60  # with <s>, </s>, <user>, <assistant>: 64 ids, the model's vocabulary
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<user>' if m['role'] != 'assistant' else '<assistant>' }}"
                 " {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
# DeepSeek-V3's own rope_scaling, the contexts shrunk: factor 4 over 256 positions
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def words(ids: list[int]) -> str:
    """The text the tokenizer reads as ``ids`` (each a word id)."""
    return " ".join(f"w{i - 4}" for i in ids)


# DeepSeek-V3's MoE, shrunk: 8 routed experts in 4 groups, 2 groups and 2 experts a token, a shared expert
MOE: dict[str, Any] = {"first_k_dense_replace": 1, "n_routed_experts": 8, "moe_intermediate_size": 32,
                       "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
                       "norm_topk_prob": True, "routed_scaling_factor": 2.5}
FP8_MAX = 448.0  # float8 e4m3's largest finite value


def write_hf_directory(path: Path, rope: dict[str, object] | None = None, seed: int = 0, *, num_layers: int = 2,
                       moe: dict[str, Any] | None = None, rope_interleave: bool = True,
                       q_lora_rank: int | None = 48) -> Path:
    """Write the directory (two layers by default, so two pipeline stages can split it) and return it.

    With ``moe`` (``MOE``'s fields, changed as given) its layers from ``first_k_dense_replace`` on are MoE, the
    router's ``e_score_correction_bias`` drawn at random (transformers initializes it to zeros, where it would
    change no choice)."""
    import transformers

    vocab = {"<s>": 0, "</s>": 1, "<user>": 2, "<assistant>": 3, **{f"w{i}": 4 + i for i in range(NUM_WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<user>", "<assistant>"]})
    experts = {**MOE, **moe} if moe is not None else {
        "first_k_dense_replace": num_layers, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
        "topk_group": 1}
    config = transformers.DeepseekV3Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=1024,
        rope_parameters=rope or YARN, rope_interleave=rope_interleave, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=1, pad_token_id=1,
        initializer_range=0.3,  # logits far enough apart that greedy picks are no coin toss
        **experts,
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[experts["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
    model = model.to(torch.bfloat16)  # checkpoints ship bfloat16
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_reference(path: Path) -> transformers.DeepseekV3ForCausalLM:
    """transformers' model from the directory, computing in float32 as kvpool does."""
    import transformers

    return transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()


def quantize_fp8(source: Path, path: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """A copy of ``source`` whose weights are stored as DeepSeek-V3 ships them: every linear layer's matrix (not
    the embedding, lm_head or router) float8 e4m3, scaled per [block_out, block_in] block so that the block's
    largest magnitude maps to 448, with the scale in ``{name}_scale_inv`` (float32), and config.json's
    ``quantization_config`` saying so."""
    shutil.copytree(source, path)
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in load_file(str(source / "model.safetensors")).items():
        if not is_quantizable(name, tuple(weight.shape)):
            tensors[name] = weight
            continue
        weight = weight.float()
        rows, cols = -(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])
        quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        scale_inv = torch.empty((rows, cols), dtype=torch.float32)
        for i, j in ((i, j) for i in range(rows) for j in range(cols)):
            where = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale = float(weight[where].abs().max()) / FP8_MAX or 1.0
            quantized[where] = (weight[where] / scale).to(torch.float8_e4m3fn)
            scale_inv[i, j] = scale
        tensors[name], tensors[name + "_scale_inv"] = quantized, scale_inv
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def dequantized_copy(source: Path, path: Path) -> Path:
    """The reference for an FP8 directory: its weights dequantized (each block times its scale) into float32,
    written as a plain directory transformers loads."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    stored = load_file(str(source / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in stored.items():
        if name.endswith("_scale_inv"):
            continue
        weight = weight.float()
        if name + "_scale_inv" in stored:
            scale_inv = stored[name + "_scale_inv"]
            for i, j in ((i, j) for i in range(scale_inv.shape[0]) for j in range(scale_inv.shape[1])):
                weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale_inv[i, j]
        tensors[name] = weight
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
