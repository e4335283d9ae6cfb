"""A broken config.json fails with a message naming the field, before any
engine process starts; real Ouro config files load without remote code."""

import json
import shutil
from pathlib import Path

import pytest
from vllm.engine.arg_utils import EngineArgs

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _engine_config(path: Path):
    return EngineArgs(model=str(path), dtype="float32", max_model_len=256).create_engine_config()


@pytest.mark.parametrize(
    "field, edit, words",
    [
        ("total_ut_steps", lambda c: c.pop("total_ut_steps"), "missing required field 'total_ut_steps'"),
        ("hidden_size", lambda c: c.pop("hidden_size"), "missing required field 'hidden_size'"),
        ("num_hidden_layers", lambda c: c.update(num_hidden_layers="two"), "'num_hidden_layers' must be a positive integer"),
        ("total_ut_steps", lambda c: c.update(total_ut_steps=0), "'total_ut_steps' must be a positive integer"),
        ("num_key_value_heads", lambda c: c.update(num_key_value_heads=3), "'num_key_value_heads' (3) must divide"),
        ("hidden_act", lambda c: c.update(hidden_act="gelu"), "'hidden_act' must be 'silu'"),
        ("rms_norm_eps", lambda c: c.update(rms_norm_eps="tiny"), "'rms_norm_eps' must be a non-negative number"),
    ],
)
def test_bad_field_is_named(tiny_checkpoint, tmp_path, field, edit, words):
    bad = _broken_copy(tiny_checkpoint, tmp_path / f"bad-{field}", edit)
    with pytest.raises(Exception) as err:
        _engine_config(bad)
    assert words in str(err.value)


@pytest.mark.parametrize("name", ["ouro-1.4b", "ouro-2.6b"])
def test_real_ouro_config_files_load_without_remote_code(tmp_path, name):
    ckpt = tmp_path / name
    ckpt.mkdir()
    shutil.copy(CONFIGS / f"{name}.config.json", ckpt / "config.json")
    assert "auto_map" in json.loads((ckpt / "config.json").read_text())
    cfg = _engine_config(ckpt)
    hf = cfg.model_config.hf_config
    assert type(hf).__name__ == "OuroConfig"
    assert cfg.model_config.trust_remote_code is False
    assert (hf.num_hidden_layers, hf.total_ut_steps, hf.hidden_size) in {(24, 4, 2048), (48, 4, 2048)}
    assert cfg.model_config.architectures == ["OuroForCausalLM"]
