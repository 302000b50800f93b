"""A Hugging Face directory written by transformers' save_pretrained: we load what transformers loads, compute the
logits and greedy tokens it computes (YaRN included), and refuse a directory we cannot serve, naming file and field."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from kvpool.model import InProcessPipeline
from kvpool.model.hf_checkpoint import checked_model_dir, model_fingerprint
from kvpool.tokenizer import HFTokenizer
from kvpool.services.decode.settings import DecodeSettings
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.services.router.settings import RouterSettings
from tests.model.hf_directory import YARN, load_reference, words, write_hf_directory
from tests.model.inputs import max_abs_diff

# YaRN as DeepSeek-V3 sets it (softmax scaled by mscale^2, cos/sin by 1), and with the cos/sin factor at work
ROPES = {"v3-yarn": YARN, "yarn-cos-sin-factor": {**YARN, "mscale": 1.0, "mscale_all_dim": 0}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_directory(tmp_path_factory.mktemp("hf") / "tiny-dsv3")


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_logits_and_greedy_tokens_equal_transformers_on_the_directory(tmp_path: Path, rope: str) -> None:
    path = write_hf_directory(tmp_path / rope, ROPES[rope])
    config = checked_model_dir(str(path)).config
    assert config.rope_scaling is not None and config.rope_interleave is True
    reference = load_reference(path)
    prompt = torch.tensor(HFTokenizer(path).encode(words(list(range(4, 64)) * 2)))  # 120 tokens
    pipe = InProcessPipeline(config, num_blocks=16, block_size=16, weights=str(path))
    with torch.inference_mode():
        ours = pipe.forward(prompt, list(range(16)), 0)
        theirs = reference(prompt.unsqueeze(0)).logits[0]
        assert max_abs_diff(ours, theirs) < 1e-4  # measured 1.4e-5 on logits up to ~10
        # the scaling matters: the same weights with plain RoPE attend differently
        plain = InProcessPipeline(dataclasses.replace(config, rope_scaling=None), 16, 16, weights=str(path))
        assert max_abs_diff(plain.forward(prompt, list(range(16)), 0), theirs) > 1e-2
        generated = reference.generate(prompt.unsqueeze(0), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None, pad_token_id=1)[0, prompt.numel():].tolist()
        assert pipe.generate_greedy(prompt, list(range(16)), 12) == generated


def test_every_role_reads_the_one_config_of_the_directory(model_dir: Path) -> None:
    config = checked_model_dir(str(model_dir)).config
    assert (config.name, config.vocab_size, config.num_hidden_layers, config.max_position_embeddings) == (
        "tiny-dsv3", 64, 2, 1024)
    prefill = PrefillSettings(model_dir=str(model_dir), num_stages=2, stage=1, port=0, admin_port=0)
    decode = DecodeSettings(model_dir=str(model_dir), port=0, admin_port=0)
    router = RouterSettings(model_dir=str(model_dir), pipelines=["p"], shards=["d"])
    assert prefill.model_config() == decode.model_config() == router.model_config() == config
    assert router.model_name == "tiny-dsv3"
    # the pool namespace names the directory's bytes, not its name: another seed is another namespace
    other = write_hf_directory(model_dir.parent / "other" / "tiny-dsv3", seed=1)
    assert model_fingerprint(str(other)) != model_fingerprint(str(model_dir))
    assert PrefillSettings(model_dir=str(other), num_stages=2, stage=1).namespace != prefill.namespace
    with pytest.raises(ValueError, match="weights: --model-dir brings its own weights"):
        DecodeSettings(model_dir=str(model_dir), weights=str(model_dir))


def test_the_tokenizer_and_chat_template_are_the_directory_s(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    assert tokenizer.eos_token_ids == (1,)
    assert tokenizer.max_token_bytes == len("<assistant>")  # its longest entry, an added token
    assert tokenizer.apply_chat_template([{"role": "user", "content": "w5 w6"}]) == [0, 2, 9, 10, 3]
    decoder = tokenizer.decoder()
    assert "".join(decoder.feed(i) for i in (9, 10, 1)) + decoder.flush() == "w5 w6"


def test_a_template_that_refuses_the_messages_is_a_value_error_naming_them(model_dir: Path, tmp_path: Path) -> None:
    """Rendered sandboxed as transformers renders it, ``raise_exception`` included (the HTTP API answers 400)."""
    path = tmp_path / "strict"
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    tokenizer = HFTokenizer(path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "w1"}]) == [5]
    with pytest.raises(ValueError, match="messages: the model's chat template refused them: no system role"):
        tokenizer.apply_chat_template([{"role": "system", "content": "w1"}])
    with pytest.raises(ValueError, match="messages: the model's chat template refused them"):  # no sandbox escape
        (path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
        HFTokenizer(path).apply_chat_template([{"role": "user", "content": "w1"}])


def broken(model_dir: Path, tmp_path: Path, change) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "broken"
    shutil.copytree(model_dir, path)
    change(path)
    with pytest.raises(ValueError) as info:
        checked_model_dir(str(path))
    return str(info.value).replace(str(path), "DIR")


def edit_config(**fields: object):  # type: ignore[no-untyped-def]
    def change(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config.update(fields)
        (path / "config.json").write_text(json.dumps(config))
    return change


@pytest.mark.parametrize("change, message", [
    (lambda p: (p / "config.json").unlink(), "model_dir: DIR/config.json: missing"),
    (lambda p: (p / "config.json").write_text("{"), "model_dir: DIR/config.json: not JSON"),
    (edit_config(model_type="llama"), "model_dir: DIR/config.json: model_type: 'llama' is not supported"),
    (edit_config(first_k_dense_replace=1),  # MoE from layer 1: the directory holds no experts
     "model_dir: DIR: weight model.layers.1.mlp.gate.weight is in no *.safetensors file"),
    (edit_config(quantization_config={"quant_method": "gptq", "bits": 4}),
     "model_dir: DIR/config.json: quantization_config.quant_method: 'gptq' is not supported"),
    (edit_config(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0}),
     "model_dir: DIR/config.json: rope_parameters: 'longrope' rope scaling is not supported"),
    (edit_config(hidden_size=32), "model_dir: DIR/model.safetensors: model.embed_tokens.weight has shape [64, 64], "
     "config.json makes it [64, 32]"),
    (edit_config(num_hidden_layers=3, first_k_dense_replace=3),
     "model_dir: DIR: weight model.layers.2.input_layernorm.weight is in no *.safetensors file"),
    (lambda p: (p / "model.safetensors").unlink(), "model_dir: DIR: no *.safetensors weights"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x00"), "model_dir: DIR/model.safetensors: not a safetensors"),
    (lambda p: (p / "tokenizer.json").unlink(), "model_dir: DIR/tokenizer.json: missing"),
    (lambda p: (p / "chat_template.jinja").unlink(), "model_dir: DIR: no chat template"),
])
def test_a_directory_it_cannot_serve_is_refused_naming_file_and_field(
    model_dir: Path, tmp_path: Path, change, message: str  # type: ignore[no-untyped-def]
) -> None:
    assert broken(model_dir, tmp_path, change).startswith(message)
