"""Merged adapters equal PEFT's `add_weighted_adapter`, and are cached, versioned and bounded.

`linear` must equal PEFT's `combination_type="cat"` (the exact weighted sum of deltas) token for
token; `ties`, `dare_linear` and `dare_ties` equal PEFT's combination types of the same names (DARE
with `torch.manual_seed(merge_seed)` as PEFT's merging begins, our generator seeded alike).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import greedy
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_cluster.adapter_format import load_peft_adapter
from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.errors import AdapterCapacityError, AdapterMergeError, AdapterNotFoundError, RequestError
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.store.admission import AdmissionPolicy
from lora_cluster.store.merge import merge
from lora_cluster.store.store import TieredAdapterStore

SEED = 1234
PROMPTS = ["the quick brown fox", "one two three four five six"]
# linear (cat): ranks 8/16/32 over different target sets, a7 is rsLoRA; PEFT's merged config copies the
# first adapter's rsLoRA flag, so the first one is a plain LoRA
LINEAR = (("a0", "a1", "a2", "a7"), (0.7, -0.4, 1.2, 0.5))
SAME_RANK = (("a0", "a6", "a12"), (0.8, 0.5, -0.6))  # rank 8 each, for ties and dare
ATOL = 1e-4


def spec_of(ids: tuple[str, ...], weights: tuple[float, ...], strategy: str = "linear", density: float = 1.0,
            sign: str = "total") -> MergeSpec:
    return MergeSpec.parse(ids, weights, strategy, density, sign, max_ids=8)


@pytest.fixture(scope="module")
def engine(make_engine):
    engine = make_engine(max_loras=4, max_lora_rank=96, merge_seed=SEED)
    yield engine
    engine.close()


def _peft_merged(model_dir, adapters_dir, ids, weights, combination: str, density: float | None = None,
                 sign: str = "total") -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters_dir / ids[0], adapter_name=ids[0])
    for aid in ids[1:]:
        model.load_adapter(adapters_dir / aid, adapter_name=aid)
    # PEFT draws DARE's masks from the global generator, after initialising the new adapter's weights
    # (which draws from it too): seed it when the merging itself begins, at its first projection
    merge_one = type(model.base_model)._generalized_task_arithmetic_weighted_adapter
    seeded = []

    def seeded_merge(self, *args, **kwargs):
        if not seeded:
            seeded.append(torch.manual_seed(SEED))
        return merge_one(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(model.base_model), "_generalized_task_arithmetic_weighted_adapter", seeded_merge)
        model.add_weighted_adapter(list(ids), list(weights), "merged", combination_type=combination,
                                   density=density, majority_sign_method=sign)
    model.set_adapter("merged")
    return model.eval()


def _greedy_matches_peft(engine: Engine, spec: MergeSpec, peft: PeftModel, what: str) -> None:
    merged_id = engine.loader.define_merge(spec)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = engine.generate(PROMPTS, adapter_ids=[merged_id] * len(PROMPTS), sampling=greedy)
    for out in outs:
        with torch.no_grad():
            logits = peft(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0].float()
        window = logits[out.prompt_tokens - 1 : -1]
        assert window.argmax(-1).tolist() == out.token_ids, f"{what}: greedy tokens equal PEFT's, one for one"
        ref = torch.log_softmax(window, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert torch.allclose(got, ref, atol=ATOL, rtol=0), f"{what}: token logprobs equal PEFT's within 1e-4"


def test_linear_is_peft_cat_token_for_token(engine, demo_model_dir, demo_adapters_dir):
    ids, weights = LINEAR
    peft = _peft_merged(demo_model_dir, demo_adapters_dir, ids, weights, "cat")
    _greedy_matches_peft(engine, spec_of(ids, weights), peft, "linear = cat")
    single = engine.generate([PROMPTS[0]], adapter_ids=["a1"], sampling=greedy(12))[0]
    merged = engine.generate([PROMPTS[0]], adapter_ids=[engine.loader.define_merge(spec_of(ids, weights))],
                             sampling=greedy(12))[0]
    assert merged.token_ids != single.token_ids, "the merge is not one of its adapters"


@pytest.mark.parametrize("strategy,density,sign", [
    ("ties", 0.5, "total"), ("ties", 0.7, "frequency"), ("dare_linear", 0.6, "total"),
    ("dare_ties", 0.5, "total"),
])
def test_ties_and_dare_equal_peft(engine, demo_model_dir, demo_adapters_dir, strategy, density, sign):
    ids, weights = SAME_RANK
    peft = _peft_merged(demo_model_dir, demo_adapters_dir, ids, weights, strategy, density, sign)
    spec = spec_of(ids, weights, strategy, density, sign)
    shapes, max_rank = engine.shapes, engine.config.max_lora_rank
    ours = merge(spec, [load_peft_adapter(a, demo_adapters_dir / a, shapes, max_rank) for a in ids],
                 list(shapes.modules), adapter_id=spec.adapter_id, max_rank=max_rank, seed=SEED)
    state = {k: v for k, v in peft.state_dict().items() if ".merged." in k}
    for (layer, module), a in ours.a.items():
        kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
        assert torch.allclose(a, state[f"{prefix}.lora_A.merged.weight"], atol=1e-6), (
            f"{strategy}: lora_A of layer {layer} {module} is PEFT's")
        assert torch.allclose(ours.b[(layer, module)], state[f"{prefix}.lora_B.merged.weight"], atol=1e-6), (
            f"{strategy}: lora_B of layer {layer} {module} is PEFT's")
    assert len(ours.a) * 2 == len(state), f"{strategy}: the merge covers PEFT's merged modules, no more"
    _greedy_matches_peft(engine, spec, peft, strategy)


def test_dare_is_deterministic(demo_adapters_dir, engine):
    ids, weights = SAME_RANK
    spec = spec_of(ids, weights, "dare_ties", 0.5)
    adapters = [load_peft_adapter(a, demo_adapters_dir / a, engine.shapes, 64) for a in ids]
    first = merge(spec, adapters, list(engine.shapes.modules), adapter_id="m", max_rank=64, seed=SEED)
    again = merge(spec, adapters, list(engine.shapes.modules), adapter_id="m", max_rank=64, seed=SEED)
    other = merge(spec, adapters, list(engine.shapes.modules), adapter_id="m", max_rank=64, seed=SEED + 1)
    key = next(iter(first.a))
    assert all(torch.equal(first.a[k], again.a[k]) for k in first.a), "the same seed gives the same merge"
    assert not torch.equal(first.a[key], other.a[key]), "another merge_seed gives other random masks"


def test_merge_limits_are_domain_errors(engine, demo_adapters_dir):
    adapters = [load_peft_adapter(a, demo_adapters_dir / a, engine.shapes, 64) for a in ("a1", "a2")]
    with pytest.raises(AdapterMergeError, match="max_lora_rank=32"):
        merge(spec_of(("a1", "a2"), (1.0, 1.0)), adapters, list(engine.shapes.modules),
              adapter_id="m", max_rank=32, seed=0)
    with pytest.raises(AdapterMergeError, match="equal ranks"):
        merge(spec_of(("a1", "a2"), (1.0, 1.0), "ties", 0.5), adapters, list(engine.shapes.modules),
              adapter_id="m", max_rank=64, seed=0)


@pytest.mark.parametrize("args,match", [
    (((), ()), "must not be empty"),
    ((("a0", "a1"), (1.0,)), "2 ids but 1 weights"),
    ((("a0",), (float("nan"),)), "finite"),
    ((("a0",), (1.0,), "svd"), "merge_strategy"),
    ((("a0",), (1.0,), "ties", 1.5), "density"),
    ((("a0",), (1.0,), "dare_linear", 0.0), "density must be > 0"),
    ((("a0",), (1.0,), "ties", 0.5, "mean"), "majority_sign_method"),
    ((("merged/abc",), (1.0,)), "merged adapter"),
    ((tuple(f"a{i}" for i in range(9)), (1.0,) * 9), "max_merged_adapter_ids"),
])
def test_invalid_merges_are_request_errors(args, match):
    with pytest.raises((RequestError, AdapterNotFoundError), match=match):
        MergeSpec.parse(*args, max_ids=8)


def test_spec_id_names_the_whole_recipe():
    base = spec_of(("a0", "a1"), (0.5, 0.5))
    assert base.adapter_id == spec_of(("a0", "a1"), (0.5, 0.5)).adapter_id, "the same recipe, the same id"
    others = [spec_of(("a1", "a0"), (0.5, 0.5)), spec_of(("a0", "a1"), (0.5, 0.6)),
              spec_of(("a0", "a1"), (0.5, 0.5), "ties", 1.0), spec_of(("a0", "a1"), (0.5, 0.5), "ties", 0.5),
              spec_of(("a0", "a1"), (0.5, 0.5), "ties", 0.5, "frequency")]
    assert len({s.adapter_id for s in [base, *others]}) == 6, "ids, weights, strategy, density, sign count"


@pytest.fixture
def store(engine, demo_adapters_dir, tmp_path):
    zoo = tmp_path / "zoo"
    shutil.copytree(demo_adapters_dir, zoo)
    policy = AdmissionPolicy(shapes=engine.shapes, max_rank=64)
    store = TieredAdapterStore([str(zoo)], policy, disk_cache_dir=tmp_path / "disk", max_merged_adapters=2,
                               merge_seed=SEED)
    yield store
    store.close()


def test_merge_is_cached_in_the_host_tier_and_rebuilt_when_an_adapter_changes(store, demo_adapters_dir):
    merged_id = store.define_merge(spec_of(("a0", "a1"), (1.0, 1.0)))
    first = store.load(merged_id)
    hits = store.stats.snapshot()["host"]["hits"]
    again = store.load(merged_id)
    assert again is first, "a second load is the host tier's copy"
    assert store.stats.snapshot()["host"]["hits"] == hits + 1, "and counts as a host hit"
    version = store.version(merged_id)
    store.register("a1", str(demo_adapters_dir / "a4"))  # a1 now names a4's weights (q,k,v,o -> o,down)
    assert store.version(merged_id) != version, "an adapter's new version is a new merged version"
    rebuilt = store.load(merged_id)
    assert rebuilt.version == store.version(merged_id), "the rebuilt merge carries the new version"
    assert {m for _, m in rebuilt.a} == {"q_proj", "v_proj", "o_proj", "down_proj"}, (
        "the rebuilt merge is of a0 and the new a1 (a4's projections)")
    assert {m for _, m in first.a} == {"q_proj", "k_proj", "v_proj", "o_proj"}, "the first was of the old a1"


def test_missing_adapter_in_a_merge_names_it(store):
    merged_id = store.define_merge(spec_of(("a0", "nope"), (1.0, 1.0)))
    with pytest.raises(AdapterNotFoundError, match="'nope'"):
        store.load(merged_id)


def test_merge_recipes_are_bounded_and_in_use_ones_kept(store):
    ids = [store.define_merge(spec_of(("a0", "a1"), (1.0, w))) for w in (0.1, 0.2)]
    store.request_started(ids[0])
    store.request_started(ids[1])
    with pytest.raises(AdapterCapacityError, match="max_merged_adapters"):
        store.define_merge(spec_of(("a0", "a1"), (1.0, 0.3)))
    store.request_finished(ids[0])
    third = store.define_merge(spec_of(("a0", "a1"), (1.0, 0.3)))
    assert store.merged.spec(ids[0]) is None, "the least recently defined recipe not in use is dropped"
    assert store.merged.spec(ids[1]) is not None and store.merged.spec(third) is not None, (
        "the in-use recipe and the new one are kept")
    assert len(store.merged) == 2, "never more than max_merged_adapters recipes"
