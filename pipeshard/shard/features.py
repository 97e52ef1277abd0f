"""The target's own features: the last stage's final hidden state, after the final norm.

Drafts that read what the target computed (EAGLE-style, services/coordinator/speculation/
feature.py) agree with it far more often than drafts that see tokens only. The state they read
is the LM head's input: the final norm's output at the positions the head scores (the
``logits_to_keep`` slice, or the paged backend's ``logits_indices`` gather), so it costs no
extra compute, exactly those rows come back, and ``head(feature)`` is the target's own logits, so
a draft can score a predicted feature with the target's head. The pre-norm state would carry
the residual stream's scale, which the norm removes anyway before anything reads it.

``add_features_output`` adds it to a last stage's model as a second result named ``features``
(after ``logits``, so output 0 stays the logits); it does not change what the logits compute.
"""

from __future__ import annotations

import openvino as ov
from openvino import opset13 as ops

from pipeshard.errors import InvalidArgument

FEATURES = "features"


def add_features_output(model: ov.Model) -> ov.Model:
    """Adds the LM head's input as the result ``features`` [B, n, H] (in place; returns it)."""
    if any(FEATURES in r.get_output_tensor(0).get_names() for r in model.get_results()):
        return model
    head = model.get_results()[0].input(0).get_source_output().get_node()
    if head.get_type_name() != "MatMul":
        raise InvalidArgument("export_dir", "the last stage's logits do not come from a MatMul LM head")
    source = head.input(0).get_source_output()
    source.get_tensor().add_names({FEATURES})
    model.add_results([ops.result(source)])
    return model
