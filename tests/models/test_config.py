"""GraniteConfig from Hugging Face config.json files."""

import json
import math

import pytest
from transformers import GraniteConfig as HFGraniteConfig
from transformers import LlamaConfig as HFLlamaConfig

from spyre_serve.models.config import ConfigError, GraniteConfig

SMALL = dict(vocab_size=300, hidden_size=128, intermediate_size=400, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def hf_json(cls, tmp_path, **kw):
    """config.json as transformers writes it, as a dict."""
    cls(**{**SMALL, **kw}).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.setdefault("architectures", ["GraniteForCausalLM" if cls is HFGraniteConfig
                                   else "LlamaForCausalLM"])
    return d


def granite_json(tmp_path, **kw):
    return hf_json(HFGraniteConfig, tmp_path, embedding_multiplier=12.0,
                   attention_multiplier=1 / 32, residual_multiplier=0.22, logits_scaling=16.0,
                   rope_theta=1e7, rms_norm_eps=1e-5, tie_word_embeddings=True, **kw)


def test_granite_fields_from_transformers_json(tmp_path):
    c = GraniteConfig.from_dict(granite_json(tmp_path))
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (300, 128, 400)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 32)
    assert (c.embedding_multiplier, c.attention_multiplier) == (12.0, 1 / 32)
    assert (c.residual_multiplier, c.logits_scaling) == (0.22, 16.0)
    assert c.rms_norm_eps == 1e-5 and c.tie_word_embeddings and c.torch_dtype == "float32"


def test_rope_theta_read_from_nested_rope_parameters(tmp_path):
    d = granite_json(tmp_path)
    assert "rope_theta" not in d and d["rope_parameters"]["rope_theta"] == 1e7
    assert GraniteConfig.from_dict(d).rope_theta == 1e7


def test_rope_theta_read_from_top_level_4x_form(tmp_path):
    d = granite_json(tmp_path)
    del d["rope_parameters"]
    d["rope_theta"] = 5e5
    assert GraniteConfig.from_dict(d).rope_theta == 5e5


def test_disagreeing_rope_theta_refused(tmp_path):
    d = granite_json(tmp_path)
    d["rope_theta"] = 1e4
    with pytest.raises(ConfigError, match="rope_theta"):
        GraniteConfig.from_dict(d)


def test_llama_gets_neutral_multipliers(tmp_path):
    c = GraniteConfig.from_dict(hf_json(HFLlamaConfig, tmp_path))
    assert c.architecture == "LlamaForCausalLM"
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (1.0, 1.0, 1.0)
    assert c.attention_multiplier == 1 / math.sqrt(32)


def test_llama_explicit_head_dim(tmp_path):
    c = GraniteConfig.from_dict(hf_json(HFLlamaConfig, tmp_path, head_dim=64))
    assert c.head_dim == 64 and c.q_size == 256 and c.kv_size == 128


def test_llama_with_granite_multiplier_refused(tmp_path):
    d = hf_json(HFLlamaConfig, tmp_path)
    d["embedding_multiplier"] = 12.0
    with pytest.raises(ConfigError, match="embedding_multiplier"):
        GraniteConfig.from_dict(d)


def test_eos_list_kept_and_int_wrapped(tmp_path):
    d = granite_json(tmp_path)
    d["eos_token_id"] = [0, 2]
    assert GraniteConfig.from_dict(d).eos_token_id == [0, 2]
    d["eos_token_id"] = 2
    assert GraniteConfig.from_dict(d).eos_token_id == [2]


@pytest.mark.parametrize("field, value, message", [
    ("attention_bias", True, "'attention_bias' is True"),
    ("mlp_bias", True, "'mlp_bias' is True"),
    ("hidden_act", "gelu", "'hidden_act' is 'gelu'"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "'rope_scaling' is {'rope_type': 'linear'"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
     "'rope_parameters.rope_type' is 'llama3'"),
    ("architectures", ["MistralForCausalLM"], "'architectures' is ['MistralForCausalLM']"),
    ("torch_dtype", "float64", "'torch_dtype' is 'float64'"),
])
def test_unsupported_option_refused_naming_field_and_value(tmp_path, field, value, message):
    d = granite_json(tmp_path)
    d.pop("dtype", None)
    d[field] = value
    with pytest.raises(ConfigError) as e:
        GraniteConfig.from_dict(d)
    assert message in str(e.value)


def test_kv_heads_not_dividing_heads_refused_with_numbers(tmp_path):
    d = granite_json(tmp_path)
    d["num_key_value_heads"] = 3
    with pytest.raises(ConfigError, match=r"num_key_value_heads.*\(3\).*\(4\)"):
        GraniteConfig.from_dict(d)


def test_missing_field_named(tmp_path):
    d = granite_json(tmp_path)
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        GraniteConfig.from_dict(d)


def test_from_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path)):
        GraniteConfig.from_file(tmp_path)


def test_to_dict_round_trips(tmp_path):
    c = GraniteConfig.from_dict(granite_json(tmp_path))
    assert GraniteConfig.from_dict(c.to_dict()) == c


def test_to_dict_read_by_transformers(tmp_path):
    c = GraniteConfig.from_dict(granite_json(tmp_path))
    hf = HFGraniteConfig(**{k: v for k, v in c.to_dict().items() if k != "architectures"})
    assert hf.rope_parameters["rope_theta"] == 1e7
    assert (hf.embedding_multiplier, hf.residual_multiplier) == (12.0, 0.22)
    assert hf.num_key_value_heads == 2 and hf.tie_word_embeddings


def test_granite_33_8b_config_as_published():
    """The fields of ibm-granite/granite-3.3-8b-instruct's config.json (4.x form)."""
    d = {"architectures": ["GraniteForCausalLM"], "model_type": "granite",
         "attention_bias": False, "attention_dropout": 0.0, "attention_multiplier": 0.0078125,
         "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
         "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
         "intermediate_size": 12800, "logits_scaling": 16.0, "max_position_embeddings": 131072,
         "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 40,
         "num_key_value_heads": 8, "pad_token_id": 0, "residual_multiplier": 0.22,
         "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0,
         "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
         "vocab_size": 49159}
    c = GraniteConfig.from_dict(d)
    assert (c.head_dim, c.q_size, c.kv_size) == (128, 4096, 1024)
    assert c.attention_multiplier == 1 / 128 and c.rope_theta == 1e7
    assert c.eos_token_id == [0] and c.torch_dtype == "bfloat16"


def test_generation_config_eos_ids_join_the_configs(tmp_path):
    from transformers import GenerationConfig

    HFGraniteConfig(**SMALL, eos_token_id=0).save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=[0, 7, 9]).save_pretrained(tmp_path)     # as Llama 3 ships it
    assert GraniteConfig.from_file(tmp_path).eos_token_id == [0, 7, 9]
    (tmp_path / "generation_config.json").unlink()
    assert GraniteConfig.from_file(tmp_path).eos_token_id == [0]


def test_generation_config_eos_outside_the_vocabulary_is_refused(tmp_path):
    HFGraniteConfig(**SMALL, eos_token_id=0).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 300]}))
    with pytest.raises(ConfigError, match=r"generation_config.json: field 'eos_token_id' holds 300"):
        GraniteConfig.from_file(tmp_path)
