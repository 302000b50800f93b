"""A Hugging Face DeepSeek-V3-architecture directory, checked whole before anything loads.

``from_hf_config`` reads a ``config.json`` into a ``ModelConfig`` and refuses,
naming the field, whatever this model would run differently from
transformers' ``DeepseekV3ForCausalLM``. ``checked_model_dir`` checks a whole
directory — ``config.json``, every weight's name and shape in the
``*.safetensors`` headers, ``tokenizer.json``, the chat template — and each
error names the file and the field. Torch-free (the safetensors headers are
read as JSON), so any role checks a directory while it reads its settings.

Supported (docs/api.md, "Serving a model directory", says the same): dense
SwiGLU MLPs, and DeepSeek-V3's MoE layers from ``first_k_dense_replace`` on
(sigmoid "noaux_tc" routing, groups, shared experts); MLA with or without
``q_lora_rank``, either RoPE layout (``rope_interleave``), RoPE unscaled or
YaRN-scaled as DeepSeek-V3 configures it; float32 / bfloat16 / float16
weights, and FP8 (e4m3) block-scaled weights with ``*_scale_inv`` as
DeepSeek-V3 and Kimi K2 ship them, dequantized at load (everything computes
in float32). ``model_type`` ``deepseek_v3``, or ``kimi_k2`` (Kimi K2 ships
this architecture under its own name). Refused: other quantizations, tied
embeddings, attention biases, another activation or MoE scoring, MoE layers
other than every layer from ``first_k_dense_replace``, other RoPE scalings,
fewer KV heads than query heads. Multi-token-prediction layers
(``num_nextn_predict_layers``) are ignored, as transformers ignores them.
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

from kvpool.model.config import ModelConfig, MoEConfig, YarnScaling
from kvpool.model.weight_names import all_weight_shapes, scale_inv_shape

MODEL_TYPE = "deepseek_v3"
# Kimi K2 ships DeepseekV3ForCausalLM under its own model_type
MODEL_TYPES = (MODEL_TYPE, "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# transformers' DeepseekV3Config defaults, where a config.json leaves a field out
HF_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096}
# transformers' defaults for the MoE fields, where a config.json leaves one out
HF_MOE_DEFAULTS: dict[str, Any] = {
    "first_k_dense_replace": 3, "n_routed_experts": 256, "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
WEIGHT_DTYPES = ("F32", "BF16", "F16")
FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16")


def from_hf_config(hf: Mapping[str, Any], name: str = "hf", seed: int = 0) -> ModelConfig:
    """A ModelConfig from a Hugging Face DeepSeek-V3 ``config.json``; a ValueError names the field it cannot run.

    A loaded checkpoint's rope layout is its config's ``rope_interleave``,
    interleaved when absent (HF's default and every DeepSeek checkpoint).
    """
    model_type = hf.get("model_type", MODEL_TYPE)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type: {model_type!r} is not supported; kvpool serves the DeepSeek-V3 "
                         f"architecture ({' or '.join(map(repr, MODEL_TYPES))})")
    architectures = hf.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:
        raise ValueError(f"architectures: {architectures} has no {ARCHITECTURE!r}")
    fp8_block_size(hf)  # refuses a quantization it cannot load
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
                       rope_scaling=_rope_scaling(rope, values["max_position_embeddings"]),
                       moe=_moe(hf, values["num_hidden_layers"]), **values)


def _moe(hf: Mapping[str, Any], num_layers: int) -> MoEConfig | None:
    """DeepSeek-V3's MoE as transformers builds it: every layer from first_k_dense_replace on (None: none is)."""
    fields = {key: hf.get(key, default) for key, default in HF_MOE_DEFAULTS.items()}
    for key, value in fields.items():
        if key == "norm_topk_prob":
            if not isinstance(value, bool):
                raise ValueError(f"{key}: must be true or false, got {value!r}")
        elif key == "routed_scaling_factor":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{key}: must be a number, got {value!r}")
            fields[key] = float(value)
        elif not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{key}: must be an integer, got {value!r}")
    if fields["first_k_dense_replace"] >= num_layers or fields["n_routed_experts"] == 0:
        return None  # every layer dense
    # what transformers' DeepseekV3MoE computes whatever these say: refuse a checkpoint that means otherwise
    for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, supported) != supported:
            raise ValueError(f"{key}: {hf[key]!r} is not supported (DeepSeek-V3's MoE: {supported!r})")
    return MoEConfig(**fields)


def fp8_block_size(hf: Mapping[str, Any]) -> tuple[int, int] | None:
    """The [out, in] block of ``quantization_config`` (None: not quantized); a ValueError names what it cannot
    load. Supported: DeepSeek-V3's FP8 — ``quant_method: fp8``, ``fmt: e4m3``, a 2-D ``weight_block_size``,
    activations quantized dynamically (so computing them in float32 needs no scale from the checkpoint)."""
    quantization = hf.get("quantization_config")
    if not quantization:
        return None
    if not isinstance(quantization, Mapping):
        raise ValueError(f"quantization_config: must be an object, got {quantization!r}")
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method: {method!r} is not supported (fp8 block-scaled "
                         "weights only, as DeepSeek-V3 ships them; dequantize others to bfloat16)")
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt: {fmt!r} is not supported (e4m3 only)")
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme: {scheme!r} is not supported (dynamic only)")
    block = quantization.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size: {block!r} is not supported (block scales "
                         "[block_out, block_in], e.g. DeepSeek-V3's [128, 128])")
    return block[0], block[1]


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
    weight_files = _check_weights(path, config, fp8_block_size(hf), where)
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


def _check_weights(path: Path, config: ModelConfig, block: tuple[int, int] | None, where: str) -> tuple[Path, ...]:
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
        if dtype == FP8_DTYPE and block is not None and len(shape) == 2:
            _check_scale(found, name, shape, block, where)
        elif dtype not in WEIGHT_DTYPES:
            fp8 = f", {FP8_DTYPE} matrices (quantization_config fp8)" if dtype == FP8_DTYPE else ""
            raise ValueError(f"{where}/{file.name}: {name} is {dtype}; supported: {', '.join(WEIGHT_DTYPES)}{fp8}")
    return files


def _check_scale(found: Mapping[str, tuple[str, tuple[int, ...], Path]], name: str, shape: tuple[int, ...],
                 block: tuple[int, int], where: str) -> None:
    scale = name + "_scale_inv"
    if scale not in found:
        raise ValueError(f"{where}: weight {name} is {FP8_DTYPE} and {scale} is in no *.safetensors file")
    dtype, scale_shape, file = found[scale]
    expected = scale_inv_shape(shape, block)
    if scale_shape != expected:
        raise ValueError(f"{where}/{file.name}: {scale} has shape {list(scale_shape)}; {list(shape)} in "
                         f"{list(block)} blocks (quantization_config.weight_block_size) makes it {list(expected)}")
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"{where}/{file.name}: {scale} is {dtype}; supported: {', '.join(SCALE_DTYPES)}")


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
