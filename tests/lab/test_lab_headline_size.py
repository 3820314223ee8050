"""The headline's GPU budget trains a GPT-2-small-class model of at least 100M parameters (the size the headline
claims), on 16 x 1024-token batches."""

from lpt.lab import headline, runs
from lpt.train import config as config_lib


def test_the_headline_model_has_at_least_100m_parameters():
    cfgs = headline.configs(False, overrides={"model.vocab_size": str(headline.VOCAB)})  # the BPE's size
    for name, cfg in cfgs.items():
        cfg = config_lib.resolve(cfg)
        assert (cfg.model.d_model, cfg.model.n_layers, cfg.data.seq_len, cfg.train.global_batch) == (768, 12, 1024, 16)
        n = runs.state_bytes(cfg)["params"]
        assert 100e6 <= n < 130e6, (name, n)
