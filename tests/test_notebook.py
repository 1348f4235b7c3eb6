"""tools/quickstart.ipynb runs top to bottom (nbclient) on tiny models saved in the zoo's format:
a target with the zoo tokenizer, an lm drafter and a feature drafter; its own asserts check that
speculative greedy output equals autoregressive and that nothing recompiles."""
import json
from pathlib import Path

import pytest
from flax import nnx

from helpers import noisy_copy

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "tools" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from specjax.io.checkpoint import save_model
    from specjax.drafters.feature import FeatureConfig, FeatureHead, save_feature_head
    from specjax.models import transformer
    from specjax.models.config import ModelConfig
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REPO / "models" / "tokenizer" / "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    target = transformer.init_model(cfg, seed=0)
    save_model(target, str(tmp_path / "target"), tokenizer=tok)
    save_model(noisy_copy(target, 0.05, seed=1), str(tmp_path / "draft"), tokenizer=tok)
    save_feature_head(FeatureHead(FeatureConfig.for_target(cfg), nnx.Rngs(0)), str(tmp_path / "feature"))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    nb.cells[params[0]].source = "\n".join([
        "from pathlib import Path",
        f"TARGET = Path({str(tmp_path / 'target')!r})",
        f"DRAFTERS = {{'lm': Path({str(tmp_path / 'draft')!r}), 'feature': Path({str(tmp_path / 'feature')!r}), 'ngram': 'ngram'}}",
        "PROMPT_TEXTS = ['def f(x):\\n    return x\\n', 'import os\\n']",
        "NEW_TOKENS = 12",
    ])
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for name in ("lm", "feature", "ngram"):
        assert f"{name} " in outputs and "tau" in outputs
    assert "(unchanged)" in outputs
    json.dumps(nb)  # executed notebook is still valid JSON
