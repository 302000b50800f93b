"""Weight names and shapes, seeded init, and safetensors save/load.

Names and [out, in] shapes follow the HF DeepSeek-V3 checkpoint
(`model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight`, ...). All weights are
float32 in memory.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvpool.model.config import ModelConfig
from kvpool.model.hf_checkpoint import fp8_block_size
from kvpool.model.weight_names import all_weight_shapes, weight_shapes

__all__ = ["WEIGHTS_FILE", "all_weight_shapes", "check_weights", "init_weights", "load_weights", "save_weights",
           "weight_shapes"]

WEIGHTS_FILE = "model.safetensors"


def init_weights(config: ModelConfig, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Seeded float32 weights, identical on every machine for one config.seed.

    Each tensor has its own generator seeded by crc32 of (config.seed, name),
    so a stage can create just its own layers and still agree with any other
    stage or the whole model. Uniform draws keep it bit-exact across CPUs
    (normal sampling takes vectorized transcendental paths). Matrices get
    std 1/sqrt(fan_in), the embedding std 1, norms 1 +- 0.1, so activations
    and attention scores stay O(1) through the layers.
    """
    shapes = all_weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for name in shapes if names is None else names:
        if name not in shapes:
            raise ValueError(f"{name!r} is not a weight of config {config.name!r}")
        shape = shapes[name]
        # the CPU generator keeps only 32 seed bits, so hash seed and name together
        generator = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{config.seed}:{name}".encode()))
        unit = torch.empty(shape, dtype=torch.float32).uniform_(-1.0, 1.0, generator=generator)
        if len(shape) == 1:
            weights[name] = 1.0 + 0.1 * unit
        else:
            std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / math.sqrt(shape[1])
            weights[name] = unit * (std * math.sqrt(3.0))  # uniform(-a, a) has std a/sqrt(3)
    return weights


def check_weights(
    weights: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise ValueError unless every named weight is present with its shape."""
    missing = [name for name in shapes if name not in weights]
    if missing:
        raise ValueError(f"missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, expected {shape}")


def save_weights(
    directory: str | Path, config: ModelConfig, weights: Mapping[str, torch.Tensor] | None = None
) -> Path:
    """Write all of config's weights (seeded ones if None) to directory/model.safetensors."""
    shapes = all_weight_shapes(config)
    weights = init_weights(config) if weights is None else weights
    check_weights(weights, shapes)
    tensors = {name: weights[name].detach().to("cpu", torch.float32).contiguous() for name in sorted(shapes)}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    path = path / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt", "kvpool_config": json.dumps(asdict(config))})
    return path


def load_weights(directory: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors (as float32) from the *.safetensors files in directory.

    An FP8 weight (float8_e4m3fn, as DeepSeek-V3 ships them) is dequantized into float32 once it and its
    ``{name}_scale_inv`` are read (each block times its scale; ``quantization_config.weight_block_size`` of the
    directory's config.json), shard by shard: float32 costs 4 bytes a parameter where FP8 took 1.
    """
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    wanted = set(names)
    weights: dict[str, torch.Tensor] = {}
    fp8: dict[str, torch.Tensor] = {}  # float8 weights and scales until both are read (a shard may split them)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            scales = {name + "_scale_inv" for name in wanted} & keys
            for name in sorted((wanted & keys) | scales):
                tensor = f.get_tensor(name)
                if tensor.dtype == torch.float8_e4m3fn or name in scales:
                    fp8[name] = tensor
                else:
                    weights[name] = tensor.to(torch.float32)
        for name in [n for n in fp8 if n in wanted and n + "_scale_inv" in fp8]:
            weights[name] = dequantize_fp8(fp8.pop(name), fp8.pop(name + "_scale_inv"), _fp8_block_size(directory))
    unscaled = sorted(name for name in fp8 if name in wanted)
    if unscaled:
        raise ValueError(f"float8 weights with no *_scale_inv in {directory}: {unscaled[:5]}")
    missing = sorted(wanted - weights.keys())
    if missing:
        raise ValueError(f"weights missing from {directory}: {missing[:5]}")
    return weights


def _fp8_block_size(directory: str | Path) -> tuple[int, int]:
    """The [out, in] block one scale covers: directory/config.json's ``quantization_config.weight_block_size``."""
    block = fp8_block_size(json.loads((Path(directory) / "config.json").read_text()))
    if block is None:
        raise ValueError(f"{directory}/config.json: float8 weights need a quantization_config (fp8, block scales)")
    return block


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``weight * scale`` of a block-scaled FP8 [out, in] matrix: ``scale_inv`` [ceil(out / block_out),
    ceil(in / block_in)] holds each block's scale (what DeepSeek-V3's ``weight_dequant`` multiplies by)."""
    rows, cols = weight.shape
    scale = scale_inv.to(torch.float32).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.to(torch.float32) * scale
