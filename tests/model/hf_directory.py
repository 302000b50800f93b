"""A tiny randomly initialized DeepSeek-V3 directory written by transformers' ``save_pretrained``: config.json with
DeepSeek-V3's YaRN scaling and interleaved RoPE, bfloat16 safetensors, a word-level tokenizer.json and a chat
template — what ``kvpool up --model-dir`` serves and transformers loads beside it."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

NUM_WORDS = 60  # with <s>, </s>, <user>, <assistant>: 64 ids, the model's vocabulary
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<user>' if m['role'] != 'assistant' else '<assistant>' }}"
                 " {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
# DeepSeek-V3's own rope_scaling, the contexts shrunk: factor 4 over 256 positions
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def words(ids: list[int]) -> str:
    """The text the tokenizer reads as ``ids`` (each a word id)."""
    return " ".join(f"w{i - 4}" for i in ids)


def write_hf_directory(path: Path, rope: dict[str, object] | None = None, seed: int = 0) -> Path:
    """Write the directory (two layers, so two pipeline stages can split it) and return it."""
    vocab = {"<s>": 0, "</s>": 1, "<user>": 2, "<assistant>": 3, **{f"w{i}": 4 + i for i in range(NUM_WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<user>", "<assistant>"]})
    config = transformers.DeepseekV3Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, max_position_embeddings=1024, rope_parameters=rope or YARN,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        initializer_range=0.3,  # logits far enough apart that greedy picks are no coin toss
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)  # checkpoints ship bfloat16
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_reference(path: Path) -> transformers.DeepseekV3ForCausalLM:
    """transformers' model from the directory, computing in float32 as kvpool does."""
    return transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
