"""Users' base models trained as they come: folders saved by transformers 4.x and 5 start the
trainer (real processes) at transformers' loss, the families whose attention differs per layer
start under tp2 x pp2 + SP, Gemma 4 trains like single card under tp2 x pp2 and resumes
under another layout, and exports load back into transformers (and our checkpoints into PaddleNLP's
models) with the same logits.

The families of 2024-2025 (Gemma 2 and 3, Phi-3, OLMo-2, SmolLM3, Granite, ERNIE 4.5, windowed Mistral
and Qwen2), each from its transformers 5 folder in one tp2 x pp2 + SP launch and its 4.x folder on one
card, with windows shorter than the batch (`workers/folders_worker.py`: the blockwise core with blocks
of 8, so windows cut across blocks), start: the loss on the batch is transformers' (1e-5), two steps train, and
each checkpoint, saved in transformers' layout (`--save_to_hf`), loads as it is in the transformers
that saved its folder with our logits (1e-4). Gemma 4 (tied, sandwich norms, q/k/v norms, windows,
a rotary and a geometry per layer type, per-layer embeddings, the last two layers reusing the first
two's keys and values across the stage boundary) trains 20 steps on one card and under tp2 x pp2, and
resumes the latter's step-10 checkpoint, saved in transformers' layout, under cp2 x tp2 + SP; so do
Qwen3.5 and Nemotron-H, their tp2 x pp2 runs with SP and full recompute (Gemma 4's sliding layers with
one key/value head: each tp rank holds their projections whole). LLaMA
(tied, Llama 3.1 rope; their own tokenizers) and GPT-2 (its fused c_attn cut into q, k, v on load; over
tp in the per-layer launch) train 3 steps on one card through the trainer's flags; the transformers 5 folders whose
fields differ in their own way start in the per-layer launch.
Qwen3's and Gemma's layers are Gemma 3's with fewer switches (per-head q/k norms, 1 + weight norms,
ties): their folders give transformers' logits (tests/test_model_folders.py) and Gemma's exports
from its transformers 5 start and loads in PaddleNLP.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import paddle
import pytest
from conftest import FOLDER_STEPS, IDS, first_batch

from checkpoint.format import TRANSFORMERS_LAYOUT, weights_layout
from checkpoint.unified_io import UnifiedReader
from modeling import multimodal
from modeling.registry import FAMILIES, load_config
from paddle_pp.interop.transformers import export_hf

import hf_models
from parity import our_logits
from runs import MICRO4, PP2, RESUME_STEP, TP2, Run, continued

pytestmark = pytest.mark.multiproc

LOSS_RTOL = 1e-5  # step 1 is a forward of the same fp32 weights on the same batch
PARITY_RTOL = 1e-4  # over 20 steps (the bound)
RESUME_RTOL = 1e-5
EXPORT_TOL = 1e-4
SP = ("--sequence_parallel",)
# the families trained 20 steps under tp2 x pp2, whose step-10 checkpoint resumes under cp2 x tp2 + SP: Gemma 4's
# windows, per-layer inputs and shared keys and values, and Qwen3.5's and Nemotron-H's recurrent layers (their state
# and conv windows carried between the parts). (Phi-3's were retired: its fused projections and longrope over tp are
# the per-layer launch's, stage3 beside tp a LLaMA resume's in tests/test_sharding_stages.py; Gemma 3's for Gemma 4's,
# whose layers have all of its but the 1 + weight norms, which Gemma 3's and Gemma's starts train.)
TWENTY_STEPS = ["gemma4_text", "qwen3_5_text", "nemotron_h"]
RESUMED_UNDER = ("--context_parallel_degree", "2") + TP2 + SP
# what a family's tp2 x pp2 run adds: the hybrids' recurrent layers (their span recompute inside) and gated attention
# under full recompute and SP
SPLIT_WITH = {"qwen3_5_text": SP + ("--recompute",), "nemotron_h": SP + ("--recompute",)}
# folders whose shape is not the runs' MODEL flags' (4 layers, 2 key/value heads): Nemotron-H's M * - on each of two
# stages; Gemma 3's one key/value head (Gemma 3 270M's and 1B's) and Gemma 4's on sliding layers, which tp2 gives
# each rank whole
FOLDER_SHAPE = {"nemotron_h": ("--num_hidden_layers", "6"), "gemma3_text": ("--num_key_value_heads", "1"),
                "gemma4_text": ("--num_key_value_heads", "1")}
# the run whose last checkpoint a PaddleNLP family exports and PaddleNLP loads (their transformers 5 starts)
EXPORTED = {"qwen2": "qwen2:transformers5", "gemma": "gemma:transformers5"}
# the kinds whose attention differs per layer, started from both versions' folders in one launch
PER_LAYER = ["gemma2", "gemma3_text", "phi3", "olmo2", "smollm3", "granite", "ernie4_5", "mpt", "mistral", "qwen2_window"]
SHORT = ("--max_steps", str(FOLDER_STEPS), "--eval_steps", "0", "--warmup_steps", "1")
# transformers 4.x folders through the trainer's flags (their own tokenizers: Llama 3's tokenizer.json, SmolLM's)
SHORT_RUNS = [(kind, "transformers4") for kind in ("llama_tied", "llama3", "gpt2")]
# transformers 5 folders of the kinds whose config or export differs in its own way (llama3 rope, linear rope with
# biases, Qwen2's layer_types, Gemma's norms, GPT-2), started in the per-layer launch; plain and tied LLaMA, Mistral
# and Qwen3 read and write the same fields (their 5.x folders' logits: tests/test_model_folders.py; a 5.x start with
# q/k norms: tests/test_moe_starts.py)
FIVE = ["llama3", "llama_linear", "qwen2", "gemma", "gpt2"]
# transformers 5 folders of the families whose token mixer differs per layer (Gated DeltaNet beside gated
# attention on each pipeline stage), started in the per-layer launch too (recurrent chunks of 8 tokens, 2 per span)
HYBRID = list(hf_models.HYBRID_KINDS)
# transformers 5 folders of the dense families of 2025-26 declared on what exists (OLMo 3, Seed-OSS, Hunyuan), started
# in the per-layer launch too
DECLARED = list(hf_models.DECLARED_KINDS)
# multimodal folders: their language model trains, the rest is carried; the layout of their first run (with the flags
# their text model's shape needs). Gemma 3's and Kimi K2.5's folders keep their first release's names
# (`language_model.model.*`, `vision_tower.*`; transformers 5.23 saves Kimi's text layers as `blocks`, read as well).
MULTIMODAL = {"qwen3_5_multimodal": (TP2, ()), "gemma3_multimodal": (TP2 + PP2, FOLDER_SHAPE["gemma3_text"]),
              "kimi_k25_multimodal": (TP2 + PP2, ("--num_key_value_heads", "4")),
              "gemma4_multimodal": (TP2 + PP2, FOLDER_SHAPE["gemma4_text"])}
# the kind whose checkpoint also resumes on one card and exports (what carries the parts is the same for every kind)
EXPORTED_MULTIMODAL = "qwen3_5_multimodal"


@pytest.fixture(scope="module")
def runs(pretrain_run, transformers4_folders, transformers5_folders):
    """The runs of this module by name, each launched once: (rank 0's result, output dir)."""
    roots = {"transformers4": transformers4_folders, "transformers5": transformers5_folders}

    @functools.cache
    def get(name: str):
        kind, _, which = name.partition(":")
        if which in ("single", "tp2pp2", "resumed"):
            start = ("--model_name_or_path", str(_root(kind, transformers4_folders, transformers5_folders) / kind),
                     *FOLDER_SHAPE.get(kind, ()))
            full = Run(f"{kind}_tp2pp2", 4, start + TP2 + PP2 + SPLIT_WITH.get(kind, ()) + MICRO4 +
                       ("--save_steps", str(RESUME_STEP), "--save_to_hf"))
            run = {"single": Run(f"{kind}_single", 1, start + ("--save_steps", "20")), "tp2pp2": full,
                   "resumed": Run(f"{kind}_resumed", 4, start + RESUMED_UNDER + MICRO4, resume_from=full)}[which]
        else:
            start = ("--model_name_or_path", str(roots[which] / kind), "--save_steps", str(FOLDER_STEPS), *SHORT)
            run = Run(f"{kind}_{which}", 1, start)
        results, out = pretrain_run(run)
        assert len({tuple(r["losses"]) for r in results}) == 1, f"{name}: ranks report different losses"
        return results[0], out

    return get


@pytest.fixture(scope="module")
def per_layer_starts(run_workers_module, transformers4_folders, transformers5_folders, tmp_path_factory):
    """The PER_LAYER, FIVE and HYBRID kinds from transformers 5's folders started in one tp2 x pp2 + SP
    launch, and the PER_LAYER kinds from 4.x's on one card (a 4.x folder differs from a 5 one in its
    config's spelling and its weights, both read before any layout applies: under tp2 x pp2 + SP it
    would run the 5 folder's code paths again): (the results by folder name `<kind>-<version>`, the
    folder of their checkpoints)."""
    links = tmp_path_factory.mktemp("per_layer")
    folders = {"transformers4": [], "transformers5": []}
    for kind, version in [(kind, version) for kind in PER_LAYER for version in ("transformers4", "transformers5")] + \
            [(kind, "transformers5") for kind in FIVE + HYBRID + DECLARED]:
        root = transformers4_folders if version == "transformers4" else transformers5_folders
        (links / f"{kind}-{version}").symlink_to(root / kind)
        folders[version].append(links / f"{kind}-{version}")
    started = {}
    for version, nproc, layout in (("transformers5", 4, (*TP2, *PP2, *SP)), ("transformers4", 1, ())):
        results = run_workers_module("folders_worker.py", nproc, [transformers5_folders / "rows.npy", links / "out", 8,
                                                                  *folders[version], *layout, "--save_to_hf"],
                                     timeout=900, tag=f"per_layer_{version}")
        assert len({json.dumps(result["folders"], sort_keys=True) for result in results}) == 1, "ranks disagree"
        started |= results[0]["folders"]
    return started, links / "out"


@pytest.fixture(scope="module")
def transformers5_checkpoint_logits(per_layer_starts, tmp_path_factory):
    """transformers 5's logits on IDS of each transformers 5 start's checkpoint (one subprocess)."""
    _, out = per_layer_starts
    ids = tmp_path_factory.mktemp("ids5") / "ids.npy"
    np.save(ids, IDS)
    kinds = PER_LAYER + FIVE + HYBRID + DECLARED
    folders = [out / f"{kind}-transformers5" / "checkpoint-2" for kind in kinds]
    hf_models.transformers5("logits", ids, *folders)
    return {kind: np.load(f"{folder}.npy") for kind, folder in zip(kinds, folders)}


@pytest.mark.parametrize("kind", PER_LAYER)
def test_a_family_whose_attention_differs_per_layer_starts_under_tp2_pp2_sp_at_transformers_loss(
        kind, per_layer_starts, transformers4_folders, transformers5_folders):
    """Both versions' folders (windows of 8 keys over 32 tokens; Gemma 2's soft-caps, Gemma 3's two
    rotary tables, Phi-3's longrope on 24 of 32 channels, SmolLM3's NoPE layers, Granite's
    multipliers, ERNIE's interleaved pairs, OLMo-2's post-norms), transformers 5's under tp2 x pp2 +
    SP and 4.x's on one card, give the loss transformers computed on the same rows, and train two
    steps (the loss falls)."""
    started, _ = per_layer_starts
    rows = np.load(transformers5_folders / "rows.npy")
    expected = {"transformers4": hf_models.loss(transformers4_folders / kind, rows),
                "transformers5": json.loads((transformers5_folders / f"{kind}.json").read_text())["loss"]}
    for version, loss in expected.items():
        result = started[f"{kind}-{version}"]
        np.testing.assert_allclose(result["loss"], loss, rtol=LOSS_RTOL, err_msg=version)
        np.testing.assert_allclose(result["losses"][0], loss, rtol=LOSS_RTOL, err_msg=version)
        assert result["losses"][1] < result["losses"][0]


@pytest.mark.parametrize("kind", PER_LAYER)
def test_a_family_whose_attention_differs_per_layer_saves_a_checkpoint_the_transformers_that_saved_it_loads(
        kind, per_layer_starts, transformers5_checkpoint_logits):
    """Each start's checkpoint in transformers' layout, as it is: transformers 4.x loads the 4.x start's
    (one card) and transformers 5 the 5 start's (tp2 x pp2 + SP; Phi-3's q, k, v and gate, up fused
    again), each with our logits."""
    _, out = per_layer_starts
    checkpoint4, checkpoint5 = (out / f"{kind}-{version}" / "checkpoint-2" for version in ("transformers4",
                                                                                         "transformers5"))
    for logits, checkpoint in ((hf_models.logits(checkpoint4, IDS), checkpoint4),
                               (transformers5_checkpoint_logits[kind], checkpoint5)):
        assert weights_layout(checkpoint) == TRANSFORMERS_LAYOUT
        np.testing.assert_allclose(logits, our_logits(checkpoint, IDS), atol=EXPORT_TOL, rtol=EXPORT_TOL)


def _root(kind: str, transformers4_folders, transformers5_folders):
    """The folders a kind's runs start from: transformers 4.x's, or 5's for the kinds only it has."""
    return transformers5_folders if kind in (*hf_models.HYBRID_KINDS, *hf_models.DECLARED_KINDS) \
        else transformers4_folders


def _transformers_loss(folder, data_cache, steps: int, eval_steps: int) -> float:
    """The loss of the transformers that saved `folder` (4.x, or 5 for the kinds only it has) on step
    1's batch of a `steps`-step run."""
    rows = first_batch(data_cache, folder, steps, eval_steps)
    five_only = (*hf_models.HYBRID_KINDS, *hf_models.DECLARED_KINDS, *hf_models.MULTIMODAL_KINDS)
    return hf_models.loss(folder, rows) if folder.name not in five_only else hf_models.transformers5_loss(folder, rows)


@pytest.mark.parametrize("kind", TWENTY_STEPS)
def test_a_new_family_starts_at_transformers_loss_and_trains_like_single_card_under_tp2_pp2(
        kind, runs, transformers4_folders, transformers5_folders, data_cache):
    """Gemma 4 under tp2 x pp2 (its per-layer inputs and shared keys and values crossing the stage),
    Qwen3.5 (a Gated DeltaNet and a gated attention layer per stage) and Nemotron-H (a Mamba-2, an attention and an MLP layer per stage) under tp2 x pp2 + SP
    recomputing whole layers: step 1's loss is that of the transformers that saved the folder (1e-5),
    and 20 steps' losses, gradient norms and evaluations are one card's (1e-4)."""
    single, _ = runs(f"{kind}:single")
    hybrid, _ = runs(f"{kind}:tp2pp2")
    folder = _root(kind, transformers4_folders, transformers5_folders) / kind
    np.testing.assert_allclose(single["losses"][0], _transformers_loss(folder, data_cache, 20, 10), rtol=LOSS_RTOL)
    np.testing.assert_allclose(hybrid["losses"], single["losses"], rtol=PARITY_RTOL)
    np.testing.assert_allclose(hybrid["grad_norms"], single["grad_norms"], rtol=PARITY_RTOL)
    np.testing.assert_allclose(hybrid["eval_loss"], single["eval_loss"], rtol=PARITY_RTOL)
    assert single["losses"][-1] < single["losses"][0] - 0.5, "the model learns"


@pytest.mark.parametrize("kind", TWENTY_STEPS)
def test_a_new_familys_checkpoint_resumes_under_another_layout_on_the_single_card_curve(kind, runs):
    """Gemma 4 (q/k/v norms, tied; windows of 8 keys, which under cp2 reach from each rank's 8-token part
    into the one before; its shared keys and values around the ring, its per-layer inputs under SP), Qwen3.5 (fused q/k/v projection and conv on disk) and Nemotron-H (fused
    in_proj and conv1d) under cp2 x tp2 + SP, from the tp2 x pp2 run's checkpoint in transformers' layout: every weight and
    Adam state read back exact, and steps 11-14 continue the single-card run (the hybrids' under context
    parallelism: their recurrent layers run each rank's parts from the states and conv windows the parts
    before leave)."""
    single, _ = runs(f"{kind}:single")
    resumed, _ = runs(f"{kind}:resumed")
    assert resumed["resumed_exactly"] is True
    np.testing.assert_allclose(resumed["losses"], continued(single["losses"]), rtol=RESUME_RTOL)


def _export_matches(checkpoint, target, theirs_logits) -> None:
    """Our logits of `checkpoint` and transformers' of its export agree."""
    np.testing.assert_allclose(theirs_logits(export_hf(checkpoint, target)), our_logits(checkpoint, IDS),
                               atol=EXPORT_TOL, rtol=EXPORT_TOL)


def _one_embedding(checkpoint, export) -> None:
    """A tied model keeps one embedding: in the checkpoint (under the embedding's name) and in the export."""
    config = load_config(checkpoint)
    if not config.tie_word_embeddings:
        return
    assert not [name for name in UnifiedReader(checkpoint, "model").tensors if "lm_head" in name]
    exported = json.loads((export / "config.json").read_text())
    assert exported.get("tie_word_embeddings", True) is True
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "np") as stored:
        assert not [name for name in stored.keys() if "lm_head" in name]


@pytest.mark.parametrize("kind", list(EXPORTED))
def test_a_new_familys_checkpoint_exports_to_transformers_and_loads_in_paddlenlp(kind, runs, tmp_path):
    _, out = runs(EXPORTED[kind])
    checkpoint = max(out.glob("checkpoint-*"), key=lambda folder: int(folder.name.split("-")[1]))
    _export_matches(checkpoint, tmp_path / "export", lambda export: hf_models.logits(export, IDS))
    _one_embedding(checkpoint, tmp_path / "export")
    family = FAMILIES[load_config(checkpoint).model_type]
    if family.paddlenlp:
        import paddlenlp.transformers as nlp

        theirs = getattr(nlp, family.architecture).from_pretrained(str(checkpoint))
        theirs.eval()
        with paddle.no_grad():
            logits = theirs(paddle.to_tensor(IDS))[0].numpy()
        np.testing.assert_allclose(logits, our_logits(checkpoint, IDS), atol=EXPORT_TOL, rtol=EXPORT_TOL)


@pytest.mark.parametrize("kind, saved_by", SHORT_RUNS, ids=[f"{kind}-{which}" for kind, which in SHORT_RUNS])
def test_a_transformers_folder_starts_at_transformers_loss_and_exports_back(
        kind, saved_by, runs, transformers4_folders, data_cache, tmp_path):
    """Each on one card with its own tokenizer (Llama 3's beginning every document with its
    <|begin_of_text|>): step 1's loss is that transformers' loss on the batch; the export after 3 steps
    gives that transformers' logits; a tied model still holds one embedding. (GPT-2's fused c_attn cut
    over tp on load: its transformers 5 folder in the per-layer launch.)"""
    result, out = runs(f"{kind}:{saved_by}")
    checkpoint = out / f"checkpoint-{FOLDER_STEPS}"
    expected = _transformers_loss(transformers4_folders / kind, data_cache, FOLDER_STEPS, 0)
    _export_matches(checkpoint, tmp_path / "export", lambda export: hf_models.logits(export, IDS))
    np.testing.assert_allclose(result["losses"][0], expected, rtol=LOSS_RTOL)
    _one_embedding(checkpoint, tmp_path / "export")


@pytest.mark.parametrize("kind", FIVE + HYBRID + DECLARED)
def test_a_transformers_5_folder_starts_at_its_loss_and_its_checkpoint_loads_back(
        kind, per_layer_starts, transformers5_folders, transformers5_checkpoint_logits):
    """Llama 3's rope, linear rope with biases, Qwen2's layer_types, Gemma's norms and GPT-2 from
    transformers 5's folders under tp2 x pp2 + SP, Qwen3.5's Gated DeltaNet and gated attention
    layers (one of each per stage; its linear layers' fused q/k/v projection and conv cut by heads
    over tp) and Olmo-Hybrid's, and Nemotron-H's Mamba-2, attention and MLP layers (its fused in_proj
    and conv1d cut by heads and groups), OLMo 3's windows and rotary per layer type, Seed-OSS's biases and Hunyuan's
    q/k norms after its fixed-alpha rotary: the loss transformers 5 computed on the rows (1e-5), and the checkpoint, in
    transformers' layout, loads in transformers 5 with our logits (1e-4), a tied model's with one
    embedding."""
    started, out = per_layer_starts
    result, checkpoint = started[f"{kind}-transformers5"], out / f"{kind}-transformers5" / "checkpoint-2"
    expected = json.loads((transformers5_folders / f"{kind}.json").read_text())["loss"]
    np.testing.assert_allclose(result["loss"], expected, rtol=LOSS_RTOL)
    np.testing.assert_allclose(transformers5_checkpoint_logits[kind], our_logits(checkpoint, IDS), atol=EXPORT_TOL,
                               rtol=EXPORT_TOL)
    if json.loads((checkpoint / "config.json").read_text()).get("tie_word_embeddings"):
        assert not [name for name in json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
                    if "lm_head" in name]


@pytest.mark.parametrize("kind", list(hf_models.MULTIMODAL_KINDS))
def test_a_multimodal_folder_gives_transformers_text_logits_and_holds_its_other_parts_as_stored(
        kind, transformers5_folders):
    """Every multimodal kind (Llama 4's too, whose text model the MoE launch trains): opened for its language
    model, our logits on text are its multimodal class's in transformers 5 (1e-5), and every tensor it does
    not train is held to be carried, none of the language model's among them."""
    from paddle_pp.interop.pretrained import open_pretrained

    folder = transformers5_folders / kind
    pretrained = open_pretrained(folder)
    kind_of = multimodal.MULTIMODAL[json.loads((folder / "config.json").read_text())["model_type"]]
    assert pretrained.carried.names and all(name.startswith(kind_of.carried) for name in pretrained.carried.names)
    assert set(pretrained.carried.names) == {name for prefix in kind_of.carried for name in _stored_bits(folder, prefix)}
    np.testing.assert_allclose(our_logits(folder, IDS), np.load(f"{folder}.npy"), rtol=LOSS_RTOL, atol=LOSS_RTOL)


def _stored_bits(folder, prefix: str) -> dict[str, tuple[str, bytes]]:
    """Every tensor of a transformers folder under `prefix`: its dtype and bytes, read by safetensors."""
    import torch
    from safetensors import safe_open

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as stored:
            for name in (name for name in stored.keys() if name.startswith(prefix)):
                tensor = stored.get_tensor(name).contiguous()
                found[name] = (str(tensor.dtype), tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return found


@pytest.mark.parametrize("kind", list(MULTIMODAL))
def test_a_multimodal_folder_trains_its_language_model_and_carries_its_vision_tower_bit_for_bit(
        pretrain_run, transformers5_folders, data_cache, tmp_path, kind):
    """Qwen3.5's multimodal folder (its language model under `model.language_model`, a vision tower
    beside) under tp2, Gemma 3's (`language_model.model`, a SigLIP tower and its projector) and Kimi
    K2.5's (a DeepSeek-V3 text model, transformers 5's `blocks` spelling, MoonViT beside) and Gemma 4's
    (per-layer inputs and shared keys and values crossing the stage; a vision and an audio tower) under
    tp2 x pp2: step 1 is the loss transformers 5's multimodal class computes on the batch (1e-5); the
    run's checkpoint, saved in transformers' layout, and (Qwen3.5's) the export of the next step's
    checkpoint (resumed from it on one card, in our layout) each hold every vision tensor as the folder
    stored it, byte for byte, keep the folder's multimodal config (Qwen3.5's rotary sections), and load
    in transformers 5 as the multimodal model with our text logits (1e-4)."""
    folder, (layout, shape) = transformers5_folders / kind, MULTIMODAL[kind]
    config = json.loads((folder / "config.json").read_text())
    start = ("--model_name_or_path", str(folder), "--eval_steps", "0", "--warmup_steps", "1", *shape)
    nproc = 4 if PP2[0] in layout else 2
    (split, *_), out = pretrain_run(Run(f"{kind}_first", nproc, start + layout + (
        "--max_steps", str(FOLDER_STEPS), "--save_steps", str(FOLDER_STEPS), "--save_to_hf")))
    np.testing.assert_allclose(split["losses"][0], _transformers_loss(folder, data_cache, FOLDER_STEPS, 0),
                               rtol=LOSS_RTOL)
    checkpoints = [out / f"checkpoint-{FOLDER_STEPS}"]
    if kind == EXPORTED_MULTIMODAL:
        _, resumed = pretrain_run(Run(f"{kind}_resumed", 1, start + (
            "--max_steps", str(FOLDER_STEPS + 1), "--save_steps", str(FOLDER_STEPS + 1), "--resume_from_checkpoint",
            str(checkpoints[0]))))
        checkpoints.append(export_hf(resumed / f"checkpoint-{FOLDER_STEPS + 1}", tmp_path / "export"))
    carried = multimodal.MULTIMODAL[config["model_type"]].carried
    vision = {name: bits for prefix in carried for name, bits in _stored_bits(folder, prefix).items()}
    assert len(vision) > 20
    ids = tmp_path / "ids.npy"
    np.save(ids, IDS)
    hf_models.transformers5("logits", ids, *checkpoints)
    for checkpoint in checkpoints:
        assert {name: bits for prefix in carried for name, bits in _stored_bits(checkpoint, prefix).items()} == vision
        written = json.loads((checkpoint / "config.json").read_text())
        assert {key: written[key] for key in config if key not in ("text_config", "transformers_version")} == \
            {key: value for key, value in config.items() if key not in ("text_config", "transformers_version")}
        if kind == "qwen3_5_multimodal":  # the vision inputs' positions
            assert written["text_config"]["rope_scaling"]["mrope_section"] == [2, 1, 1]
        np.testing.assert_allclose(np.load(f"{checkpoint}.npy"), our_logits(checkpoint, IDS), atol=EXPORT_TOL,
                                   rtol=EXPORT_TOL)
