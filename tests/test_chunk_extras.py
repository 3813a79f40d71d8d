"""``PipelineChunk``'s registered extras (``hftrain.parallel.chunk.ChunkExtra``): an extra's tensors travel at the end
of the activation tuple from the first chunk to the last, which hands them to its ``finish``; the chunks' output is
the model's, exactly; ``chunk.routing`` / ``chunk.context_split`` register and drop the named extras. One process."""

from __future__ import annotations

import contextlib


def test_an_extra_travels_through_the_chunks_and_leaves_the_output_alone():
    import torch

    from hftrain.parallel import build_stage_modules
    from hftrain.parallel.chunk import ChunkExtra, PipelineChunk
    from hftrain.parallel.stages import PipelineChunk as ReExported
    from tests.test_pp_stages import _batch, _model

    class Counter(ChunkExtra):
        """Carries the number of layers run so far (one tensor) and records what the last chunk received."""

        name, width = "counter", 1

        def __init__(self, layers: int) -> None:
            self.layers_here, self.finished, self.entered = layers, None, 0

        @contextlib.contextmanager
        def layers(self):
            self.entered += 1
            yield

        def carry(self, received, attention_mask, device):
            before = torch.zeros(()) if received is None else received[0]
            return (before + self.layers_here,)

        def finish(self, carried):
            self.finished = carried[0].item()

    assert ReExported is PipelineChunk
    model = _model("bert", layers=4)
    ids, mask, _ = _batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    chunks = [c for rank in range(2) for c in build_stage_modules(model, pp_rank=rank, pp=2)]
    counters = [Counter(len(chunk.layers)) for chunk in chunks]
    for chunk, counter in zip(chunks, counters, strict=True):
        assert chunk.extras == [] and chunk.routing is None and chunk.context_split is None
        chunk.register(counter)
        chunk.register(counter)  # one per name
        assert chunk.extras == [counter] and chunk.extra("counter") is counter
    acts = (ids, mask)
    for chunk in chunks:
        with chunk.microbatch(), torch.no_grad():  # evaluation: no finish
            acts = chunk(*acts)
        acts = acts if isinstance(acts, tuple) else (acts,)
        if not chunk.is_last:
            assert acts[-1].item() == sum(len(c.layers) for c in chunks[: chunks.index(chunk) + 1])
    (logits,) = acts
    assert torch.equal(logits, expected)
    assert counters[-1].finished is None and all(c.entered == 1 for c in counters)
    acts = (ids, mask)
    for chunk in chunks:  # training: the last chunk's finish takes what every stage carried
        acts = chunk(*acts)
        acts = acts if isinstance(acts, tuple) else (acts,)
    assert counters[-1].finished == 4
    chunks[0].routing = counters[0]  # the compatibility setter registers under the extra's own name...
    chunks[0].context_split = None  # ...and None drops the named one (none here)
    assert chunks[0].extras == [counters[0]]
