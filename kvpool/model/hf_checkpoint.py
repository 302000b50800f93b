"""A Hugging Face DeepSeek-V3-architecture directory, checked whole before anything loads.

``from_hf_config`` reads a ``config.json`` into a ``ModelConfig`` and refuses,
naming the field, whatever this model would run differently from
transformers' ``DeepseekV3ForCausalLM``. ``checked_model_dir`` checks a whole
directory — ``config.json``, every weight's name and shape in the
``*.safetensors`` headers, ``tokenizer.json``, the chat template — and each
error names the file and the field. Torch-free (the safetensors headers are
read as JSON), so any role checks a directory while it reads its settings.

Supported (docs/api.md, "Serving a model directory", says the same): dense
SwiGLU MLPs in every layer, MLA with or without ``q_lora_rank``, either RoPE
layout (``rope_interleave``), RoPE unscaled or YaRN-scaled as DeepSeek-V3
configures it, float32 / bfloat16 / float16 weights (computed in float32).
Refused: MoE layers, quantized weights, tied embeddings, attention biases,
another activation, other RoPE scalings, fewer KV heads than query heads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.model.config import ModelConfig, YarnScaling
from kvpool.model.weight_names import all_weight_shapes

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# transformers' DeepseekV3Config defaults, where a config.json leaves a field out
HF_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096}
WEIGHT_DTYPES = ("F32", "BF16", "F16")


def from_hf_config(hf: Mapping[str, Any], name: str = "hf", seed: int = 0) -> ModelConfig:
    """A ModelConfig from a Hugging Face DeepSeek-V3 ``config.json``; a ValueError names the field it cannot run.

    A loaded checkpoint's rope layout is its config's ``rope_interleave``,
    interleaved when absent (HF's default and every DeepSeek checkpoint).
    """
    model_type = hf.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise ValueError(f"model_type: {model_type!r} is not supported; kvpool serves the DeepSeek-V3 "
                         f"architecture ({MODEL_TYPE!r})")
    architectures = hf.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:
        raise ValueError(f"architectures: {architectures} has no {ARCHITECTURE!r}")
    if hf.get("quantization_config"):
        raise ValueError("quantization_config: quantized weights are not supported (dequantize them to "
                         "bfloat16 or float32)")
    layers = hf.get("num_hidden_layers", 0)
    if hf.get("n_routed_experts") and hf.get("first_k_dense_replace", 0) < layers:
        raise ValueError(f"n_routed_experts: MoE layers are not supported (dense MLPs only: first_k_dense_replace "
                         f"must be num_hidden_layers, {layers}, got {hf.get('first_k_dense_replace', 0)})")
    heads = hf.get("num_attention_heads")
    if hf.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads: {hf['num_key_value_heads']} differs from num_attention_heads "
                         f"{heads} (MLA gives every head its own key)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {hf['hidden_act']!r} is not supported (silu only)")
    for flag in ("attention_bias", "tie_word_embeddings"):
        if hf.get(flag):
            raise ValueError(f"{flag}: true is not supported")
    values: dict[str, Any] = {}
    for key in SHAPE_FIELDS:
        if key not in hf:
            raise ValueError(f"{key}: missing")
        value = hf[key]
        integer = isinstance(value, int) and not isinstance(value, bool)
        if not integer and not (key == "q_lora_rank" and value is None):
            raise ValueError(f"{key}: must be an integer, got {value!r}")
        values[key] = value
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    for key, default in HF_DEFAULTS.items():
        value = rope.get(key, hf.get(key)) if key == "rope_theta" else hf.get(key)
        values[key] = default if value is None else value
    values["rope_theta"] = float(values["rope_theta"])
    values["rms_norm_eps"] = float(values["rms_norm_eps"])
    interleave = hf.get("rope_interleave")
    return ModelConfig(name=name, seed=seed, rope_interleave=True if interleave is None else bool(interleave),
                       rope_scaling=_rope_scaling(rope, values["max_position_embeddings"]), **values)


def _rope_scaling(rope: Mapping[str, Any], max_position_embeddings: int) -> YarnScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"rope_parameters: {kind!r} rope scaling is not supported (default or yarn)")
    if "original_max_position_embeddings" not in rope:
        raise ValueError("rope_parameters.original_max_position_embeddings: missing (yarn needs it)")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor")
    if factor is None:  # as HF: the ratio of the contexts
        factor = max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    return YarnScaling(
        factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(rope.get("truncate", True)))


def load_hf_config(directory: str | Path, name: str | None = None) -> ModelConfig:
    """``from_hf_config`` of ``directory/config.json``."""
    path = Path(directory) / "config.json"
    return from_hf_config(json.loads(path.read_text()), name or Path(directory).name)


@dataclass(frozen=True, slots=True)
class ModelDir:
    """A directory that passed ``checked_model_dir``: its config and its weight files."""

    path: Path
    config: ModelConfig
    weight_files: tuple[Path, ...] = ()


@functools.cache
def model_fingerprint(directory: str) -> str:
    """sha256 of config.json and every weight file, once per process: the pool namespace's model identity, so
    two directories share cached KV only when their bytes are the same (``--model-id`` names them instead)."""
    model_dir = checked_model_dir(directory)
    digest = hashlib.sha256((model_dir.path / "config.json").read_bytes())
    for path in model_dir.weight_files:
        with path.open("rb") as fh:
            digest.update(hashlib.file_digest(fh, "sha256").digest())
    return digest.hexdigest()[:32]


@functools.cache
def checked_model_dir(directory: str) -> ModelDir:
    """The directory checked whole, once per process: a ValueError names ``model_dir``, the file and the field."""
    path = Path(directory)
    where = f"model_dir: {path}"
    if not path.is_dir():
        raise ValueError(f"{where} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{where}/config.json: missing (a Hugging Face model directory's config)")
    try:
        hf = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}/config.json: not JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{where}/config.json: not a JSON object")
    if "model_type" not in hf:
        raise ValueError(f"{where}/config.json: model_type: missing (kvpool serves {MODEL_TYPE!r})")
    try:
        config = from_hf_config(hf, path.resolve().name)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}/config.json: {exc}") from None
    weight_files = _check_weights(path, config, where)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{where}/tokenizer.json: missing (the tokenizer the router encodes and decodes with)")
    if chat_template(path) is None:
        raise ValueError(f"{where}: no chat template (chat_template.jinja, or chat_template in "
                         "tokenizer_config.json)")
    return ModelDir(path, config, weight_files)


def chat_template(path: Path) -> str | None:
    """The directory's chat template: ``chat_template.jinja`` (transformers 5 writes it), else
    ``tokenizer_config.json``'s ``chat_template``."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) and template else None


def _check_weights(path: Path, config: ModelConfig, where: str) -> tuple[Path, ...]:
    files = tuple(sorted(path.glob("*.safetensors")))
    if not files:
        raise ValueError(f"{where}: no *.safetensors weights")
    found: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for file in files:
        for name, (dtype, shape) in _safetensors_header(file, where).items():
            found[name] = (dtype, shape, file)
    for name, shape in all_weight_shapes(config).items():
        if name not in found:
            raise ValueError(f"{where}: weight {name} is in no *.safetensors file")
        dtype, shape_found, file = found[name]
        if shape_found != shape:
            raise ValueError(f"{where}/{file.name}: {name} has shape {list(shape_found)}, config.json makes it "
                             f"{list(shape)}")
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"{where}/{file.name}: {name} is {dtype}; supported: {', '.join(WEIGHT_DTYPES)}")
    return files


def _safetensors_header(file: Path, where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a safetensors file's header: 8 bytes of length, then JSON."""
    try:
        with file.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > 100 << 20:
                raise ValueError(f"a {length}-byte header")
            header = json.loads(fh.read(length))
        return {name: (entry["dtype"], tuple(entry["shape"])) for name, entry in header.items()
                if name != "__metadata__"}
    except (ValueError, struct.error, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}/{file.name}: not a safetensors file ({exc})") from None
