"""Model folders as users bring them, read in one process: what transformers 4.x and 5 saved gives
transformers' logits in our model, every config field that would change the model and is not
modelled is refused by name, hub tokenizers give transformers' ids, PaddleNLP's folders give
PaddleNLP's logits, and every family builds from flags.

References are transformers' and PaddleNLP's own models, made inside the test (`hf_models`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest
from conftest import IDS

from checkpoint.format import CheckpointError
from modeling.attention_core import CORES
from modeling.config import ModelConfigError
from modeling.deepseek import DeepseekV3Config
from modeling.execution import Execution
from modeling.registry import (
    FAMILIES,
    LayoutModelError,
    config_from_dict,
    core_notes,
    family_of,
    load_config,
    plan_of,
    validate_layout,
)
from paddle_pp.data.preprocess import preprocess
from paddle_pp.data.tokenizer import load_text_tokenizer
from paddle_pp.interop.pretrained import PADDLENLP, TRANSFORMERS, load_pretrained, open_pretrained, our_config_of
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.decoding import carries_state
from paddle_pp.training.generation import load_generator
from paddle_pp.training.model_config import model_config

import hf_models
from parity import our_logits
from runs import CORPUS

LOGITS_TOL = 1e-5  # fp32, the same weights; summation orders differ (measured: at most 1e-6)


@pytest.mark.parametrize("kind", list(hf_models.KINDS))
def test_a_folder_saved_by_transformers_4_or_5_gives_transformers_logits(kind, transformers4_folders,
                                                                          transformers5_folders):
    """LLaMA (plain, tied, rope llama3 and linear with biases), Mistral, Qwen2 (biases, tied), Qwen3
    (q/k norms, head_dim), Gemma and GPT-2, each saved by transformers 4.55 and by 5 (config.json
    `rope_parameters` and `dtype`); our model gives the logits of the transformers that saved it."""
    for root in (transformers4_folders, transformers5_folders):
        assert open_pretrained(root / kind).kind == TRANSFORMERS
        np.testing.assert_allclose(our_logits(root / kind, IDS), np.load(root / f"{kind}.npy"), atol=LOGITS_TOL,
                                   rtol=LOGITS_TOL, err_msg=json.loads((root / f"{kind}.json").read_text())["version"])


@pytest.mark.parametrize("kind", list(hf_models.VARIANT_KINDS))
def test_a_variant_of_a_family_gives_transformers_5_logits(kind, transformers5_folders):
    """Granite 4.0-H without experts (its shared MLP the whole feed-forward part) and with rotary
    attention, Falcon-H1 with Mamba-2's gated norm before and after the gate, Gemma 4 31B's layers (keys
    as values on full layers, without per-layer inputs or shared keys, a soft-cap that bends the
    logits): our model gives the logits of transformers 5, which saved it."""
    np.testing.assert_allclose(our_logits(transformers5_folders / kind, IDS), np.load(transformers5_folders / f"{kind}.npy"),
                               atol=LOGITS_TOL, rtol=LOGITS_TOL)


def test_a_released_qwen3_5_configs_own_fields_are_read_as_transformers_reads_them(transformers5_folders, tmp_path):
    """Qwen's released Qwen3.5 configs write `attn_output_gate` and `mamba_ssm_dtype`, which transformers 5
    reads past: true (its full layers are always gated) and any cache dtype give transformers' logits; a
    gate turned off is another model, refused by name."""
    source = transformers5_folders / "qwen3_5_text"
    released = _edited(source, tmp_path / "released", attn_output_gate=True, mamba_ssm_dtype="float32")
    np.testing.assert_allclose(our_logits(released, IDS), np.load(f"{source}.npy"), atol=LOGITS_TOL, rtol=LOGITS_TOL)
    with pytest.raises(CheckpointError, match=r"attn_output_gate=False \(changes the model"):
        open_pretrained(_edited(source, tmp_path / "ungated", attn_output_gate=False))


PROMPT, NEW_TOKENS = IDS[:1, :20], 12


@pytest.fixture(scope="module")
def hybrid_greedy(transformers5_folders, tmp_path_factory) -> dict[str, list[int]]:
    """transformers 5's own greedy `generate` (with its cache) of NEW_TOKENS after PROMPT, per hybrid kind."""
    prompt = tmp_path_factory.mktemp("prompt") / "prompt.npy"
    np.save(prompt, PROMPT)
    folders = [transformers5_folders / kind for kind in hf_models.HYBRID_KINDS]
    hf_models.transformers5("greedy", prompt, NEW_TOKENS, *folders)
    return {folder.name: np.load(f"{folder}.greedy.npy")[0].tolist() for folder in folders}


@pytest.mark.parametrize("kind", list(hf_models.HYBRID_KINDS))
def test_generation_carries_the_recurrent_state_to_transformers_greedy_tokens(kind, transformers5_folders,
                                                                             hybrid_greedy):
    """`tools/generate.py`'s generator on the hybrid families (Qwen3.5, Olmo-Hybrid, Nemotron-H, Falcon-H1):
    after a 20-token prompt each new token runs alone, the recurrent layers carrying their conv inputs and
    state; greedy, it gives the 12 tokens transformers 5's own `generate` gives."""
    generator = load_generator(transformers5_folders / kind)
    assert carries_state(generator.model)
    assert generator.token_ids(PROMPT[0].tolist(), NEW_TOKENS) == hybrid_greedy[kind]


def _edited(source: Path, target: Path, **fields) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **fields}))
    return target


REFUSED = {  # kind, config.json fields, what the refusal names
    "unknown_field": ("llama", {"fancy_attention": True}, r"fancy_attention=True \(a field paddle-pp does not know"),
    "yarn_without_factor": ("llama", {"rope_scaling": {"rope_type": "yarn", "beta_fast": 16}}, "rope_type 'yarn' needs factor"),
    "dynamic_rope": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type 'dynamic' is not modelled"),
    "transformers5_yarn": ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
                           "rope_type 'dynamic' is not modelled"),
    "llama3_key_missing": ("llama3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                           "rope_type 'llama3' needs low_freq_factor"),
    "attention_dropout": ("mistral", {"attention_dropout": 0.1}, r"attention_dropout=0.1 \(only 0.0 is modelled\)"),
    "activation": ("qwen2", {"hidden_act": "relu"}, "hidden_act='relu' is not modelled"),
    "quantized": ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config="),
    "gpt2_dropout": ("gpt2", {"resid_pdrop": 0.1}, r"resid_pdrop=0.1 \(only 0.0 is modelled\)"),
    "gpt2_activation": ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
    "gemma_activations_disagree": ("gemma", {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"},
                                   "hidden_activation='gelu_pytorch_tanh'"),
    # PaddleNLP's Mistral has no fused projections: a folder saying so has an unknown layout
    "fused_paddlenlp_weights": ("mistral", {"fuse_attention_qkv": True},
                                "sets fuse_attention_qkv, which PaddleNLP's MistralForCausalLM does not have"),
    "other_architecture": ("llama", {"model_type": "deepseek_v4"},
                           "model_type 'deepseek_v4' is not one of .*DeepSeek-V4 is not modelled"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_config_field_that_changes_the_model_and_is_not_modelled_is_refused_by_name(
        case, transformers4_folders, tmp_path):
    kind, fields, message = REFUSED[case]
    with pytest.raises(CheckpointError, match=message):
        open_pretrained(_edited(transformers4_folders / kind, tmp_path / case, **fields))


GEMMA4_REFUSED = {  # config.json fields of a Gemma 4 folder, what the refusal names
    "experts_unsized": ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 8, "moe_intermediate_size": 16},
                        r"enable_moe_block needs .* top_k_experts between 1 and num_experts \(given 4, 16, 8\)"),
    "encoder": ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
    "sliding_override": ({"per_layer_config": {"0": {"head_dim": 32}, "1": {"head_dim": 32}, "3": {"head_dim": 32}}},
                         "per_layer_config=.*only the same head_dim and num_key_value_heads on every full_attention"),
    "full_rotary": ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
                    "rope_type 'linear': Gemma 4's full layers are modelled with its 'proportional' rotary"),
    "orphan_sharing": ({"num_kv_shared_layers": 3}, "no layer before the shared ones is of type full_attention"),
}


@pytest.mark.parametrize("case", list(GEMMA4_REFUSED))
def test_a_gemma4_folder_asking_for_what_is_not_modelled_is_refused_by_name(case, transformers5_folders, tmp_path):
    """26B-A4B's experts asked to choose more experts than there are, an encoder's bidirectional
    attention, per-layer overrides other than the full layers' geometry, another rotary on the full layers, shared layers of a type no earlier
    layer computes: each named before a model is built."""
    fields, message = GEMMA4_REFUSED[case]
    folder = _edited(transformers5_folders / "gemma4_text", tmp_path / case, **fields)
    with pytest.raises((CheckpointError, ModelConfigError), match=message):
        args = parse_args(["--model_name_or_path", str(folder), "--max_seq_length", "32"])
        model_config(args.model, 32, 4096, open_pretrained(folder), args.given).validate()


def test_a_gemma4_folder_whose_full_layer_rotary_omits_its_factor_turns_every_pair_as_transformers_does(
        transformers5_folders, tmp_path):
    """transformers reads `partial_rotary_factor` as 1 when a folder's full-layer rotary leaves it out (a
    quarter only when the folder gives no rotary at all): our logits are transformers 5's on that folder."""
    config = json.loads((transformers5_folders / "gemma4_text" / "config.json").read_text())
    full = {key: value for key, value in config["rope_parameters"]["full_attention"].items()
            if key != "partial_rotary_factor"}
    folder = _edited(transformers5_folders / "gemma4_text", tmp_path / "gemma4_whole_rotary",
                     rope_parameters={**config["rope_parameters"], "full_attention": full})
    assert config_from_dict(open_pretrained(folder).config).partial_rotary_factor == 1.0
    ids = tmp_path / "ids.npy"
    np.save(ids, IDS)
    hf_models.transformers5("logits", ids, folder)
    theirs = np.load(f"{folder}.npy")
    np.testing.assert_allclose(our_logits(folder, IDS), theirs, atol=LOGITS_TOL, rtol=LOGITS_TOL)
    assert np.abs(theirs - np.load(transformers5_folders / "gemma4_text.npy")).max() > 100 * LOGITS_TOL


def test_a_gemma4_folder_keeping_projections_its_shared_layers_do_not_use_reads_as_transformers_does(
        transformers5_folders, tmp_path):
    """Some folders keep k_proj / k_norm for the layers that reuse earlier keys and values (transformers'
    ignore list): they are left unread with a note, and the logits are transformers' without them."""
    from safetensors.numpy import load_file, save_file

    folder = _edited(transformers5_folders / "gemma4_text", tmp_path / "gemma4_extra")
    weights = load_file(str(folder / "model.safetensors"))
    weights |= {"model.layers.2.self_attn.k_proj.weight": np.ones((16, 64), np.float32),
                "model.layers.3.self_attn.k_norm.weight": np.ones((32,), np.float32)}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (note,) = open_pretrained(folder).notes
    assert "2 tensors under model.layers.2.self_attn.k_proj., model.layers.3.self_attn.k_norm. left unread" in note
    np.testing.assert_allclose(our_logits(folder, IDS), np.load(transformers5_folders / "gemma4_text.npy"),
                               atol=LOGITS_TOL, rtol=LOGITS_TOL)


def test_a_gemma4_model_is_refused_under_the_interleaved_schedules_before_any_process_group(transformers5_folders):
    """What travels beside its hidden states changes from stage to stage, which 1F1B sends and vpp and
    DualPipeV (one cached shape) do not: refused by name, 1F1B accepted."""
    config = load_config(transformers5_folders / "gemma4_text")
    for schedule in ({"virtual_pp_degree": 2}, {"pipeline_schedule": "DualPipeV"}):
        with pytest.raises(LayoutModelError, match="what its layers hand to later layers .* travels between"):
            validate_layout(config, Layout(world_size=2, pipeline_parallel_degree=2, **schedule))
    validate_layout(config, Layout(world_size=2, pipeline_parallel_degree=2))


@pytest.mark.parametrize("model_type, name", [("minimax_m2", "MiniMax-M2"), ("hy_v3", "Hy3")])
def test_a_sigmoid_routed_model_asking_for_transformers_softmax_balance_loss_is_refused_by_name(model_type, name):
    """MiniMax-M2 and Hy3 choose experts by sigmoid plus a correction bias, which balances them; the loss
    transformers adds under `output_router_logits` ranks them by a softmax they are not chosen by."""
    with pytest.raises(ModelConfigError, match=f"output_router_logits=true: {name}'s balance loss .* by sigmoid"):
        config_from_dict({"model_type": model_type, "output_router_logits": True}).validate()
    config_from_dict({"model_type": model_type}).validate()


def test_gemma4_31bs_full_layers_take_the_blockwise_core_where_flash_cannot_compute_them():
    """FlashAttention-2 computes head sizes up to 256: under the flash core (a GPU run's) Gemma 4 31B's
    full layers (512 wide) take the blockwise core, and the run's start says which."""
    released = Path(__file__).resolve().parents[1] / "bench" / "configs" / "gemma4_31b.json"  # as the planner reads it
    config = config_from_dict(our_config_of(json.loads(released.read_text()), released))
    assert (config.global_head_dim, config.num_global_key_value_heads, config.attention_k_eq_v) == (512, 4, True)
    full = [str(index) for index in range(config.num_hidden_layers) if config.layer_types[index] == "full_attention"]
    assert core_notes(config, Execution(attention=CORES["flash"])) == [
        f"attention: decoder layers {', '.join(full)} take the blockwise core (the flash core does not compute a "
        "head size of 512 (FlashAttention-2 computes at most 256))"]


@pytest.mark.parametrize("kind, fields, windows", [
    ("mistral", {"sliding_window": 16}, [16] * 4),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2, "layer_types": None},
     [None, None, 16, 16]),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 16, "layer_types": ["sliding_attention"] * 4},
     [None] * 4)], ids=["mistral", "qwen2", "qwen2_without_use_sliding_window"])
def test_a_sliding_window_is_declared_on_the_layers_transformers_slides(kind, fields, windows, transformers4_folders,
                                                                        tmp_path):
    """Mistral slides every layer; Qwen2 from `max_window_layers` on under `use_sliding_window`, and
    not at all without it whatever `layer_types` says (transformers drops the window); a window
    shorter than the sequence trains (transformers' logits with windows shorter than the batch:
    `test_a_folder_saved_by_transformers_4_or_5_gives_transformers_logits`)."""
    folder = _edited(transformers4_folders / kind, tmp_path / kind, **fields)
    args = parse_args(["--model_name_or_path", str(folder), "--max_seq_length", "32"])
    config = model_config(args.model, 32, 4096, open_pretrained(folder), args.given)
    assert [config.decoder_layer(i).attention.spec.window for i in range(4)] == windows


def test_a_folder_paddleformers_saved_starts_as_it_is(transformers4_folders, tmp_path):
    """PaddleFormers 1.2's save_pretrained adds `fuse_rms_norm` (its fused RMSNorm kernel switch) and
    `paddleformers_version` to config.json (read in its source: PaddleFormers is not installed here);
    such a folder was refused by name, and now gives the same logits as without them."""
    kind = transformers4_folders / "llama"
    folder = _edited(kind, tmp_path / "paddleformers", fuse_rms_norm=False, paddleformers_version="1.2.0")
    np.testing.assert_array_equal(our_logits(folder, IDS), our_logits(kind, IDS))


TEXTS = ["The hacker ethic, in 1984.", "  two  spaces\nand a newline", "naïve café — ünïcödé ✓ 日本", ""]


TOKENIZER_CASES = [*hf_models.TOKENIZER_STYLES, "vocab_and_merges_only", "gemma_config_only"]


@pytest.mark.parametrize("style", TOKENIZER_CASES)
def test_a_hub_tokenizer_folder_gives_transformers_ids_and_preprocesses(style, tmp_path):
    """Llama 3's tokenizer.json alone (its template begins a text with <|begin_of_text|>), Qwen2's and
    SmolLM's (GPT2Tokenizer) folders as transformers saves them, a GPT-2 folder of vocab.json + merges.txt
    without tokenizer.json, and Gemma's (add_bos_token in tokenizer_config.json; also with tokenizer.json's
    template removed): transformers 4.x's ids with and without the special tokens, in generation's
    prompts (with them) and in preprocessing (each document begun as the folder declares, or not at all
    under --no-add_bos_token); and the special ids transformers 5 puts around each text (its Qwen2 and
    Gemma classes rebuild the rest of the pipeline from vocab and merges, which for these folders
    trained with a byte-level pre-tokenizer splits text otherwise). Where the two versions disagree,
    tokenizer.json without a template beside add_bos_token (transformers 5 drops the setting when
    tokenizer.json exists), we add what the folder's settings name, as 4.x's Gemma and Llama classes do."""
    import transformers

    base = {"vocab_and_merges_only": "smollm", "gemma_config_only": "gemma"}.get(style, style)
    folder = hf_models.hub_tokenizer(base, tmp_path / style, CORPUS)
    if style == "vocab_and_merges_only":
        (folder / "tokenizer.json").unlink()
    if style == "gemma_config_only":
        whole = json.loads((folder / "tokenizer.json").read_text())
        (folder / "tokenizer.json").write_text(json.dumps(whole | {"post_processor": None}))
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    (tmp_path / "texts.json").write_text(json.dumps(TEXTS))
    hf_models.transformers5("encoded", tmp_path / "texts.json", folder)
    ours = load_text_tokenizer(folder)
    for text, five in zip(TEXTS, json.loads((tmp_path / f"{style}.encoded.json").read_text())):
        ids = theirs(text, add_special_tokens=False).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.encode_declared(text) == theirs(text).input_ids, text
        if style != "gemma_config_only":
            assert five["with"] == [*ours.prefix, *five["without"], *ours.suffix], text
    assert (ours.eos_id, ours.vocab_size) == (theirs.eos_token_id, len(theirs))
    assert bool(ours.prefix) == (base in hf_models.BEGINS)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS[:3]))
    from paddlenlp.data.indexed_dataset import MMapIndexedDataset

    for begun in (True, False):
        prefix = tmp_path / f"prepared_{begun}"
        preprocess([str(tmp_path / "docs.jsonl")], folder, prefix, append_eos=True, show_progress=False,
                   add_bos_token=begun)
        prepared = MMapIndexedDataset(str(prefix))  # the tool strips each document's text
        assert [list(prepared[i]) for i in range(len(prepared))] == \
            [theirs(text.strip(), add_special_tokens=begun).input_ids + [theirs.eos_token_id] for text in TEXTS[:3]]


NLP_SHAPE = {k: v for k, v in hf_models.SHAPE.items()} | {"num_key_value_heads": 2}
PADDLENLP_FAMILIES = {"llama": {}, "llama_tied": {"tie_word_embeddings": True}, "mistral": {"sliding_window": None},
                      "qwen2": {"tie_word_embeddings": True}, "gemma": {"head_dim": 32}}


@pytest.mark.parametrize("name", list(PADDLENLP_FAMILIES))
def test_a_paddlenlp_folder_gives_paddlenlps_logits(name, tmp_path):
    """PaddleNLP 3.0.0b4's own models (each family it has), saved by its save_pretrained."""
    import paddlenlp.transformers as nlp

    family = FAMILIES[name.split("_")[0]]
    paddle.seed(3)
    theirs = getattr(nlp, family.architecture)(
        getattr(nlp, family.architecture.replace("ForCausalLM", "Config"))(**NLP_SHAPE, **PADDLENLP_FAMILIES[name]))
    with paddle.no_grad():
        for param in theirs.parameters():
            if len(param.shape) == 1:
                param.set_value(param + 0.1 * paddle.randn(param.shape))
    theirs.save_pretrained(tmp_path / name, safe_serialization=True)
    theirs.eval()
    with paddle.no_grad():
        expected = theirs(paddle.to_tensor(IDS))[0].numpy()
    assert open_pretrained(tmp_path / name).kind == PADDLENLP
    np.testing.assert_allclose(our_logits(tmp_path / name, IDS), expected, atol=LOGITS_TOL, rtol=LOGITS_TOL)


PADDLENLP_MOE = {"qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 48},
                 "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2}}


@pytest.mark.parametrize("name", list(PADDLENLP_MOE))
def test_a_paddlenlp_moe_folder_loads_exactly_its_tensors(name, tmp_path):
    """PaddleNLP 3.0.0b4's Qwen2-MoE and Mixtral (router stored [hidden, experts], as ours), saved by
    its save_pretrained: every tensor lands in our model bit for bit, and nothing is left over. Their
    logits cannot be the reference: both models fail their first forward on Paddle 3.3.1 (checked
    here, so the day they run this test must compare logits instead)."""
    import paddlenlp.transformers as nlp

    family = FAMILIES[name]
    paddle.seed(3)
    theirs = getattr(nlp, family.architecture)(
        getattr(nlp, family.architecture.replace("ForCausalLM", "Config"))(**NLP_SHAPE, **PADDLENLP_MOE[name]))
    theirs.save_pretrained(tmp_path / name, safe_serialization=True)
    pretrained = open_pretrained(tmp_path / name)
    assert pretrained.kind == PADDLENLP
    config = config_from_dict(pretrained.config)
    ours = family.causal_lm(config)
    load_pretrained(pretrained, ours, plan_of(config).axes(), None)
    expected = {key: value.numpy() for key, value in theirs.state_dict().items()}
    loaded = {key: value.numpy() for key, value in ours.state_dict().items()}
    assert loaded.keys() == expected.keys()
    assert all(np.array_equal(loaded[key], expected[key]) for key in expected)
    theirs.eval()
    with pytest.raises((TypeError, ValueError)), paddle.no_grad():
        theirs(paddle.to_tensor(IDS))


# From flags a family takes its released sizes for what no flag sets: Kimi Linear's 256 experts of 1024 (and
# 32 Kimi Delta heads of 128) take 30 s to build and run here, Mistral 4's 128 experts of 2048 on both layers
# most of that; their folders build in tests/test_moe_starts.py
BUILT_FROM_FOLDERS_ONLY = ("kimi_linear", "mistral4")


@pytest.mark.parametrize("model_type", [name for name in FAMILIES if name not in BUILT_FROM_FOLDERS_ONLY])
def test_every_family_builds_from_flags(model_type):
    latent = issubclass(FAMILIES[model_type].config_class, DeepseekV3Config)  # MLA: kv heads are the heads, head sizes its own
    args = parse_args(["--model_type", model_type, "--hidden_size", "64", "--num_attention_heads", "4",
                       "--intermediate_size", "96", "--num_hidden_layers", "2"]
                      + ([] if model_type == "gpt" or latent else ["--num_key_value_heads", "2", "--head_dim", "24"]))
    config = model_config(args.model, 32, 4096, None, args.given)
    assert (config.model_type, config.vocab_size, config.hidden_size, config.num_hidden_layers) == \
        (model_type, 4096, 64, 2)
    if model_type != "gpt" and not latent:
        assert (config.num_key_value_heads, config.head_dim) == (2, 24)
    model = family_of(config).causal_lm(config)
    family_of(config).check_built(model, config, model.run, pp=1, stage=0)
    assert model(paddle.to_tensor(IDS[:, :8])).shape == [2, 8, 4096]
    assert {"lm_head.weight" in model.state_dict()} == {not config.tie_word_embeddings}


PER_LAYER_KINDS = ["gemma2", "gemma3_text", "phi3", "olmo2", "smollm3", "granite", "ernie4_5", "mpt", "mistral"]


@pytest.mark.parametrize("kind", PER_LAYER_KINDS)
def test_generation_of_each_new_family_is_transformers_greedy_generate(kind, transformers4_folders):
    """`tools/generate.py`'s generator on a folder of each family: greedy from a 20-token prompt (past
    the windows of 8 keys) gives the tokens of transformers' own `generate` with eager attention."""
    import torch
    import transformers

    generator = load_generator(transformers4_folders / kind)
    prompt = IDS[0, :20].tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(transformers4_folders / kind),
                                                              attn_implementation="eager").eval()
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    assert generator.token_ids(prompt, 8) == theirs
