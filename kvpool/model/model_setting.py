"""The ``model`` / ``model_dir`` pair of every role's settings, read one way by all of them."""

from __future__ import annotations

from kvpool.model.config import ModelConfig, get_config
from kvpool.model.hf_checkpoint import checked_model_dir
from kvpool.model.weight_names import weight_nbytes


class ModelSetting:
    """Base of a settings class with ``model`` and ``model_dir`` fields: the config of the Hugging Face directory
    when one is given (``kvpool.model.hf_checkpoint``, checked once per process), else the built-in config the
    name names; a bad name or directory is a ValueError naming the field (settings errors name what to fix)."""

    __slots__ = ()
    model: str
    model_dir: str

    def model_config(self) -> ModelConfig:
        if self.model_dir:
            return checked_model_dir(self.model_dir).config
        try:
            return get_config(self.model)
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None

    def weight_memory(self, layer_start: int, layer_end: int) -> dict[str, int]:
        """The float32 weights of layers [layer_start, layer_end), every expert included, by what sizes them (the
        model's name or directory): a service's ``memory()`` counts them beside what its own settings size."""
        config = self.model_config()
        return {f"{'model_dir' if self.model_dir else 'model'} weights": weight_nbytes(config, layer_start, layer_end)}
