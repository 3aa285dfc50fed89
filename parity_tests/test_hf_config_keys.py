"""Every key of every supported family's config class, accounted for (``mha_spec.config_keys``).

For each family ``from_hf`` supports, each attribute of the installed transformers config class
(its default instance's ``to_dict()`` keys, its dataclass fields, a nested config's keys: MPT's
``attn_config``) is read by the family's record, refused by name when set, or listed as not the
attention's with its reason. A key that a newer transformers adds fails here until it is placed.
The lists are then held to what they say: a key listed as not the attention's leaves every
layer's options as they were when its value changes; a refused key raises naming itself; and a
key the record reads, left out of a config.json, reads as the config class fills it in.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers

from mha_spec import config_keys, families, latent, records
from parity_tests.test_hf_families import RECORDS, Supported, _config

SUPPORTED = sorted(name for name, record in RECORDS.items() if isinstance(record, Supported))
DERIVED = ("layer_types", "no_rope_layers", "mlp_layer_types")  # keys config classes fill in from others
NO_KEYS = ("gpt-sw3",)  # GPT-2's classes: its configs say model_type gpt2


def _default(name: str):
    return transformers.CONFIG_MAPPING[name]()


def _keys(name: str) -> set[str]:
    """The config class's attributes: its default's ``to_dict()`` keys, dataclass fields and nested config keys."""
    config = _default(name)
    raw = config.to_dict()
    keys = set(raw)
    if dataclasses.is_dataclass(type(config)):
        keys |= {f.name for f in dataclasses.fields(type(config)) if not f.name.startswith("_")}
    nested = families.FAMILIES[name].nested if name in families.FAMILIES else None  # a multimodal's: in text_config
    if nested and isinstance(raw.get(nested), dict):
        keys |= set(raw[nested])
    return keys


_ALIASED = {v for f in families.FAMILIES.values() for v in f.aliases.values()} | set(records.ALIASES.values())
# a size a released config may leave to its class's declared default (Gemma 3's text_config has no head count)
DECLARED_SIZE = "num_attention_heads"
SIZES = ("model_type", "hidden_size", "num_attention_heads", "num_hidden_layers", *DERIVED, *sorted(_ALIASED))


def _resized(cls, saved: dict, hidden: int) -> dict:
    """The config class's save at other sizes (``hidden``, 6 heads, 5 layers; twice ``hidden`` where its class
    rejects those: a Mamba mixer's heads must divide twice the hidden size)."""
    other = {records.ALIASES.get(k, k) if k not in saved else k: v
             for k, v in (("hidden_size", hidden), ("num_attention_heads", 6), ("num_hidden_layers", 5))}
    try:
        return cls(**other).to_dict()
    except Exception:  # noqa: BLE001 -- transformers' validators raise their own errors
        if hidden > 96:
            raise
        return _resized(cls, saved, 2 * hidden)


def class_defaults(name: str) -> dict:
    """The defaults of the keys ``name``'s record reads, as its config class declares them (a dataclass field's
    own default, before ``__post_init__`` derives from it), else as its default instance saves them where they do
    not change with the sizes; sizes (but the head count a class declares), per-layer lists and the keys the record
    derives itself left out."""
    cls = transformers.CONFIG_MAPPING[name]
    saved = cls().to_dict()
    resized = _resized(cls, saved, 96)
    declared = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            value = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            if value is not None:
                declared[f.name] = value
    read, family = config_keys.keys_read(name), families.FAMILIES[name]
    derived = getattr(family.standardize, "derives", ())
    out = {}
    for key in sorted(read & set(saved) - (set(SIZES) - {DECLARED_SIZE}) - set(derived)):
        if key in declared and not isinstance(declared[key], (dict, list)):
            out[key] = declared[key]
        elif key != DECLARED_SIZE and key in resized and saved[key] == resized[key]:
            out[key] = saved[key]
    if family.nested and isinstance(out.get(family.nested), dict):
        out[family.nested] = {k: v for k, v in out[family.nested].items() if k in read and k != "model_type"}
    return out


def render_class_defaults() -> str:
    """``mha_spec/config_defaults.json`` regenerated: ``python -c "from parity_tests.test_hf_config_keys import
    render_class_defaults as r; open('mha_spec/config_defaults.json', 'w').write(r())"``."""
    defaults = {name: class_defaults(name) for name in SUPPORTED if name not in NO_KEYS + tuple(records.MULTIMODAL)}
    return json.dumps(defaults, indent=1, sort_keys=True) + "\n"


def test_the_class_defaults_are_those_of_the_installed_config_classes():
    """``CLASS_DEFAULTS`` as ``render_class_defaults`` writes it from the installed transformers."""
    assert families.CLASS_DEFAULTS == json.loads(render_class_defaults())


@pytest.mark.parametrize("name", SUPPORTED)
def test_every_key_of_the_config_class_is_read_refused_or_not_the_attentions(name):
    assert config_keys.unaccounted(name, _keys(name)) == [], "keys neither read, refused nor listed"


def test_the_lists_of_keys_that_are_not_the_attentions_are_of_supported_families_and_not_read():
    assert set(config_keys.FAMILY_NOT_ATTENTION) <= set(families.FAMILIES)
    for name, listed in config_keys.FAMILY_NOT_ATTENTION.items():
        assert not set(listed) & config_keys.keys_read(name), name
        assert not set(listed) & set(config_keys.NOT_ATTENTION), name  # once, in one list


def _changed(value):
    """Another value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 3
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, (list, tuple)):
        return list(value) + list(value[:1])
    if isinstance(value, dict):
        return dict(value, other=1)
    return 7 if value is None else None


def _all_options(raw: dict) -> list:
    """Each attention layer's options, its rotary as the arguments the modules get (not the config it is read
    from)."""
    options = [families.layer_options(families.read_config(raw), layer)
               for layer in families.attention_layers(raw)]
    return [dataclasses.replace(o, rope=latent.layer_rotary(o)) for o in options]


@pytest.mark.parametrize("name", [n for n in SUPPORTED if n not in NO_KEYS])
def test_a_key_listed_as_not_the_attentions_leaves_every_layer_as_it_was(name):
    """Each such key of the family's small config (transformers' save of it), changed: the same
    options on every layer (so the record does not read it)."""
    record = RECORDS[name]
    raw = _config(name, record.config, record.layers).to_dict()
    before = _all_options(raw)
    listed = set(config_keys.NOT_ATTENTION) | set(config_keys.FAMILY_NOT_ATTENTION.get(name, {}))
    for key in sorted(listed & set(raw) - config_keys.keys_read(name)):
        assert _all_options(dict(raw, **{key: _changed(raw[key])})) == before, key


@pytest.mark.parametrize("name", [n for n in SUPPORTED if n not in NO_KEYS])
def test_a_refused_key_set_raises_naming_itself(name):
    record = RECORDS[name]
    raw = _config(name, record.config, record.layers).to_dict()
    for key in sorted(config_keys.keys_refused(name)):
        with pytest.raises(ValueError, match=rf"config \({name}\) sets .*{key} \("):
            families.layer_options(families.read_config(dict(raw, **{key: True})), 0)


@pytest.mark.parametrize("name", [n for n in SUPPORTED if n not in NO_KEYS])
def test_a_key_the_record_reads_left_out_reads_as_the_config_class_fills_it_in(name):
    """Each key of the family's small config that the record reads, left out of the config.json:
    where transformers' config class fills in the value it had (its saved dict the same), every
    layer's options are those of the whole config; the per-layer keys a class derives are left out
    too (a config.json need not hold them)."""
    record = RECORDS[name]
    config = _config(name, record.config, record.layers)
    raw = config.to_dict()
    bare = {k: v for k, v in raw.items() if k not in DERIVED}
    before = _all_options(raw)
    for key in sorted(set(bare) & config_keys.keys_read(name) - set(SIZES)):  # a config.json holds the sizes
        left = {k: v for k, v in bare.items() if k != key}
        keywords = {k: v for k, v in left.items() if k != "model_type"}
        try:
            refilled = transformers.AutoConfig.for_model(name, **keywords).to_dict()
        except Exception:  # noqa: BLE001 -- a key the class requires: a config.json holds it
            continue
        if {k: v for k, v in refilled.items() if k not in ("transformers_version",)} != \
                {k: v for k, v in raw.items() if k not in ("transformers_version",)}:
            continue  # the class fills in another value (or derives it from what was left)
        assert _all_options(left) == before, key
