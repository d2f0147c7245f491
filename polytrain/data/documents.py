"""Document boundaries inside packed token windows.

Windows of a prepared token file (packed.py) run across documents, each ended by
`<|endoftext|>`. For long-context training with document masks, each token gets the id of
the document it belongs to (the end-of-text token closes its document) and its position
inside that document, so attention never crosses a boundary and every document's
positions start at 0:

    ids = document_ids(inputs, eot_id)           # (B, T)
    logits = model(inputs, positions=document_positions(ids), documents=ids)
"""

from __future__ import annotations

import torch

from polytrain.models.common.documents import document_positions

__all__ = ["document_ids", "document_positions"]


def document_ids(tokens: torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) id of each token's document: the number of end-of-text tokens before it in its row."""
    ends = (tokens == eot_id).long()
    return ends.cumsum(dim=1) - ends  # an end-of-text token still belongs to the document it ends
