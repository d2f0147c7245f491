"""Rows to batches: prompt formats, length limits, right padding and the masks of prompt and padding tokens."""

import pytest
import torch

from polytrain.data import sort_task
from polytrain.data.preference import Row
from polytrain.data.tokenizer import train_bpe
from polytrain.errors import ConfigError
from polytrain.inference.chat import PLAIN
from polytrain.rlhf.batches import (
    IGNORE, Encoder, PromptFormat, pair_batch, response_mask, right_pad, sft_batch,
)


@pytest.fixture(scope="module")
def tok():
    return train_bpe(sort_task.corpus_text(300, 0) + ["User: Assistant:\n"], 280)


def test_prompt_formats():
    assert PromptFormat("{prompt}")(" Human: hi Assistant:") == " Human: hi Assistant:"
    assert PromptFormat("Q: {prompt}\nA:")("hi") == "Q: hi\nA:"
    assert PromptFormat("chat", PLAIN)("hi") == "User: hi\nAssistant:"
    with pytest.raises(ConfigError, match="must contain {prompt} or be 'chat'"):
        PromptFormat("no placeholder")
    with pytest.raises(ConfigError, match="needs a chat template"):
        PromptFormat("chat", None)


def test_encoder_joins_prompt_response_and_end_of_text(tok):
    enc = Encoder(tok, PromptFormat("{prompt}"), seq_len=24, max_prompt_len=16)
    row = Row(sort_task.prompt_for([3, 1, 2]), chosen=" 1 2 3", rejected=" 1 3 2")
    ids, n_prompt = enc.sft(row)
    assert ids[:n_prompt] == tok.encode(row.prompt) and ids[-1] == tok.eot_id
    assert tok.decode(ids[n_prompt:-1]) == " 1 2 3"
    chosen, rejected = enc.pair(row)
    assert chosen == ids and rejected[:n_prompt] == ids[:n_prompt] and rejected != chosen
    short = Encoder(tok, PromptFormat("{prompt}"), seq_len=n_prompt + 2, max_prompt_len=16)
    assert len(short.sft(row)[0]) == n_prompt + 2  # the response is cut to fit seq_len
    tight = Encoder(tok, PromptFormat("{prompt}"), seq_len=24, max_prompt_len=n_prompt - 1)
    with pytest.raises(ConfigError, match=rf"the prompt of a.jsonl line 3 is {n_prompt} tokens, over the limit "
                                          rf"of {n_prompt - 1} \(rlhf.max_prompt_len"):
        tight.prompt(Row(row.prompt, response=" 1", where="a.jsonl line 3"))


def test_masks_cover_response_tokens_only():
    # Row 0: prompt [5, 6], response [7, 8]; row 1: prompt [5, 6, 9], response [4]; pad 0.
    seqs, prompt_lens = [[5, 6, 7, 8], [5, 6, 9, 4]], [2, 3]
    ids, lengths = right_pad([s[:4] for s in seqs] + [[1, 2]], 0)
    assert ids.tolist()[2] == [1, 2, 0, 0] and lengths.tolist() == [4, 4, 2]
    mask = response_mask(torch.tensor(prompt_lens + [1]), lengths, 4)
    # shifted position t scores token t + 1: row 0 scores tokens 2, 3; row 1 token 3; row 2 token 1.
    assert mask.tolist() == [[False, True, True], [False, False, True], [True, False, False]]
    inputs, targets = sft_batch([([5, 6, 7, 8], 2), ([5, 6, 4], 2)], pad_id=0, mask_prompt=True)
    assert inputs.tolist() == [[5, 6, 7], [5, 6, 4]]
    assert targets.tolist() == [[IGNORE, 7, 8], [IGNORE, 4, IGNORE]]
    _, unmasked = sft_batch([([5, 6, 7, 8], 2), ([5, 6, 4], 2)], pad_id=0, mask_prompt=False)
    assert unmasked.tolist() == [[6, 7, 8], [6, 4, IGNORE]]  # DeepSpeed-Chat: the prompt is scored too
    ids, lengths = pair_batch([([1, 2, 3], [1, 2]), ([4], [4, 5, 6, 7])], pad_id=0)
    assert ids.shape == (4, 4) and lengths.tolist() == [3, 1, 2, 4]
