"""Property test of the validator (issue 16): mutate valid configs the ways a person gets them wrong
(a value of another type, a key deleted, a key renamed by one letter, a value out of range, a block
replaced by a scalar). Every mutation must either pass `validate` and then build a DeepSpeed engine
on a tiny model, or raise ConfigError naming a key. Any other exception, from the validator or from
deepspeed.initialize after the validator passed it, fails the test."""
import collections
import copy
import string

import deepspeed
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers.config import build_config, validate
from helpers.errors import ConfigError
from helpers.model import build_model
from helpers.runtime import init_single_process, quiet_deepspeed

EXAMPLES = 30    # derandomized: the same 30 mutations every run (each may build an engine: 50 cost 55 s of CI, 250 2.7 minutes)

# Valid starting points: every ZeRO stage, both CPU precisions, accumulation, optimizer offload (CPU Adam).
BASES = [
    build_config(zero_stage=0, torch_adam=True),
    build_config(zero_stage=1, precision="bf16", grad_accum=2, torch_adam=True),
    build_config(zero_stage=2, offload_optimizer=True),
    build_config(zero_stage=3, precision="bf16", torch_adam=True, extra={"communication_data_type": "fp32"}),
]

ANY_VALUE = st.one_of(st.text(string.printable, max_size=6), st.booleans(), st.integers(-3, 10**9),
                      st.floats(-1e12, 1e12, allow_nan=False), st.none(), st.lists(st.integers(-2, 2), max_size=3),
                      st.just({}), st.just({"enabled": True}))


def key_paths(config: dict, prefix=()):
    for key, value in config.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from key_paths(value, prefix + (key,))


def misspelled(draw, key: str) -> str:
    """`key` with one letter inserted, deleted or replaced."""
    letters = string.ascii_lowercase + "_"
    at = draw(st.integers(0, len(key) - 1))
    edit = draw(st.sampled_from(["insert", "delete", "replace"]))
    if edit == "delete" and len(key) > 1:
        return key[:at] + key[at + 1:]
    letter = draw(st.sampled_from(letters).filter(lambda c: c != key[at]))
    return key[:at] + letter + key[at + (edit == "replace"):]


def out_of_range(draw, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return draw(ANY_VALUE)
    return draw(st.sampled_from([0, -1, -abs(value) - 1, 10**12, 1e-30, type(value)(value) * 1000 + 7]))


@st.composite
def mutations(draw):
    """(mutated config, the names a refusal may point at, what was done)."""
    config = copy.deepcopy(draw(st.sampled_from(BASES)))
    path = draw(st.sampled_from(list(key_paths(config))))
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    kind = draw(st.sampled_from(["type", "delete", "rename", "range", "scalar"]))
    names = list(path)
    if kind == "delete":
        del parent[key]
    elif kind == "rename":
        new = misspelled(draw, key)
        parent[new] = parent.pop(key)
        names.append(new)
    elif kind == "range":
        parent[key] = out_of_range(draw, value)
    elif kind == "scalar" and isinstance(value, dict):
        parent[key] = draw(st.one_of(st.integers(-1, 3), st.booleans(), st.text(max_size=4), st.none()))
    else:   # another JSON type, or the value written as a string (the "1.0" mistake)
        parent[key] = draw(st.one_of(ANY_VALUE, st.just(str(value))).filter(lambda v: type(v) is not type(value)))
    return config, names, kind


def build_engine(config: dict):
    model = build_model(vocab_size=64, n_positions=16, size="tiny", seed=0)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    engine.destroy()


def test_every_mutation_is_refused_by_name_or_builds_an_engine():
    quiet_deepspeed("ERROR")
    init_single_process()
    outcomes = collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations())
    def check(mutation):
        config, names, kind = mutation
        try:
            validate(config, device="cpu")
        except ConfigError as err:
            assert any(str(name) in str(err) for name in names), f"{kind} of {names}: '{err}' names none of them"
            outcomes["refused"] += 1
            return
        try:
            build_engine(config)
        except Exception as err:   # the validator passed a config DeepSpeed cannot build
            pytest.fail(f"validate accepted {kind} of {names}, then deepspeed.initialize raised "
                        f"{type(err).__name__}: {err}\nconfig: {config}")
        outcomes["built"] += 1

    check()
    print(dict(outcomes))
    assert sum(outcomes.values()) >= EXAMPLES and outcomes["refused"] and outcomes["built"]
