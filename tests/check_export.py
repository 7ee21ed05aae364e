"""Run by hand (needs torch and transformers, which the trainer does not): an exported checkpoint gives
transformers' LlamaForCausalLM the same logits as our model on the same tokens.

    pip install torch transformers
    python tests/check_export.py RUN_DIR EXPORT_DIR [the model keys the run was trained with]
"""
import os
import sys

import jax
import numpy as np
import sentencepiece as spm
import torch
from flax import nnx
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model  # noqa: E402  (after the repository is on the path)
import train  # noqa: E402


def main(run, hf, *keys):
    cfg = train.load_config(os.path.join(os.path.dirname(train.__file__), 'base.yml'),
                            ['dtype=float32', 'mesh=1,1,1', *keys])
    mesh = train.make_mesh(cfg, jax.devices()[:1])
    abstract = train.state_layout(cfg, model.TASKS['lm'], mesh, train.make_optimizer(cfg)[0], 1).abstract
    path, steps = train.data.checkpoint_steps(run)
    with train.checkpoints(path, cfg, read_only=True) as mngr:
        params = train.restore_checkpoint(mngr, abstract, cfg, steps, part='params')[1]
    sp = spm.SentencePieceProcessor(model_file=os.path.join(hf, 'tokenizer.model'))
    text = open(train.__file__).read()  # any text: the trainer's own source
    ids = np.array([[sp.bos_id()] + sp.encode(text)[:cfg.max_target_length - 1]], np.int32)
    positions = np.arange(ids.shape[1])[None]
    ours = np.asarray(nnx.merge(model.abstract(cfg)[0], params)(ids, positions, np.ones_like(ids)))
    theirs = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    theirs = theirs(torch.tensor(ids, dtype=torch.long)).logits.detach().numpy()
    diff = np.abs(ours - theirs)
    print(f'max |diff| {diff.max():.3g} = {diff.max() / np.abs(theirs).max():.3g} of the largest logit')
    assert np.allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


if __name__ == '__main__':
    main(*sys.argv[1:])
