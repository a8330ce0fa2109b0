"""What the mixture-of-experts tests share: their tolerances, the kinds of folders they build
(`conftest.moe_folders`), the start flags of a run from one, and our model's view of a folder
(logits, routing margins, prediction layers)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import paddle

from modeling.registry import config_from_dict, family_of, plan_of
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained

import hf_models
from runs import PP2, TP2

LOGITS_TOL = 1e-5  # fp32, the same weights and routing (measured: at most 4.2e-7)
EXPORT_TOL = 1e-4
LOSS_RTOL = 1e-5
PARITY_RTOL = 1e-4
RESUME_RTOL = 1e-5
AUX_RTOL = 1e-5
MARGIN = 1e-4  # least gap between the k-th and (k+1)-th router logit of a routed token (layouts differ by ~1e-6)
ROUTING_NOISE = 1e-6  # how far apart two layouts' router scores come over 20 steps (their summation orders)
KINDS = list(hf_models.MOE_KINDS)
# the kinds whose transformers 5 folders start under the 8-rank split layout: all but plain DeepSeek-V3, whose folder
# with a prediction layer (MTP_KIND: the same weights and one layer more) starts there, and Mixtral, whose layers
# are Qwen3-MoE's without q/k norms (its own tensor names are read before any layout applies)
SPLIT_KINDS = [kind for kind in KINDS if kind not in ("deepseek_v3", "mixtral")]
# MoE kinds only transformers 5 has: those whose token mixer differs per layer (Gated DeltaNet, KDA or Mamba-2 beside
# attention), GLM-4.7-Flash (DeepSeek-V3's layers, dense or with experts as mlp_layer_types says), Llama 4, Mistral 4 and
# Hunyuan-A13B
FIVE_ONLY_KINDS = [*hf_models.HYBRID_MOE_KINDS, *hf_models.DECLARED_MOE_KINDS]
MTP_KIND = "deepseek_v3_mtp"  # transformers 5's DeepSeek-V3 folder given a multi-token prediction layer
# such folders: from which kind's, with how many prediction layers (GLM's two chained, as transformers chains them)
PREDICTING = {MTP_KIND: ("deepseek_v3", 1), "glm4_moe_mtp": ("glm4_moe", 2)}
VERSIONS = ("transformers4", "transformers5")
SPLIT_VERSION = "transformers5"  # the folders the split layout starts


def our_model(folder, train: bool = False):
    pretrained = open_pretrained(folder)
    config = config_from_dict(pretrained.config)
    model = family_of(config).causal_lm(config)
    load_pretrained(pretrained, model, plan_of(config).axes(), None)
    model.train() if train else model.eval()
    return model, config


def routed_margins(model, ids: np.ndarray) -> list[float]:
    """Each MoE layer's least routing margin on `ids` (`Routing.margin`: the gap between a token's k-th
    and (k+1)-th choice, and between the last kept and the next group), as the model routed them."""
    margins = []
    for layer in model.sublayers():
        if type(layer).__name__ == "SparseMoE":
            route = layer.route

            def recorded(flat, layer=layer, route=route):
                out = route(flat)
                margins.append(float(layer.declared.routing.margin(out[0], layer.router_layer.correction)))
                return out

            layer.route = recorded
    with paddle.no_grad():
        model(paddle.to_tensor(ids))
    return margins


def assert_margins(margins: list[float]) -> None:
    assert min(margins) > MARGIN, f"a token sits {min(margins):.2g} from a routing tie: reseed the test folders"



def start_flags(kind: str, root) -> tuple[str, ...]:
    return ("--model_name_or_path", str(root / kind))


EP2, EP4 = ("--expert_parallel_degree", "2"), ("--expert_parallel_degree", "4")
DP2_TP2_PP2_SP = TP2 + PP2 + ("--sequence_parallel",)  # on 8 ranks: dp 2


def counting_an_absent_prediction_layer(source, folder):
    """A copy of `source` (saved by transformers, which builds no prediction layer) whose config.json
    counts one, as a fine-tune of a released DeepSeek-V3 or GLM-4.5 that transformers saved does."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return folder


DEEPSEEK = ("--num_key_value_heads", "4")  # MLA's kv heads are its heads (the runs' MODEL flags say 2)


def predictions(folder, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our (next-token logits, each prediction layer's logits [depth, ...]) of `ids` from `folder`
    (training mode: the prediction layers run in training only)."""
    model, _ = our_model(folder, train=True)
    with paddle.no_grad():
        main, *depths = model(paddle.to_tensor(ids))
    return main.numpy(), np.stack([depth.numpy() for depth in depths])

