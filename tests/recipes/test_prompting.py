"""The few-shot prompt and the stop sequences, rendered with a tiny offline ChatML tokenizer."""

from types import SimpleNamespace

from recipes.grpo_lib import FEWSHOT_PREFIX, QUESTION_SUFFIX, build_messages, render_prompt, stop_sequences


def test_fewshot_text_matches_the_upstream_demo():
    assert QUESTION_SUFFIX == " Provide a numerical answer without units, written inside \\boxed{}."
    assert [m["role"] for m in FEWSHOT_PREFIX] == ["user", "assistant"]
    assert FEWSHOT_PREFIX[0]["content"] == "How many r's are in strawberry?" + QUESTION_SUFFIX
    assert FEWSHOT_PREFIX[1]["content"].endswith(
        "1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. "
        "We have r's at positions 3, 8, and 9. There are three r's. \\boxed{3}"
    )


def test_build_messages_appends_question_with_suffix():
    msgs = build_messages("What is 12 + 30?")
    assert msgs[:2] == FEWSHOT_PREFIX
    assert msgs[2] == {"role": "user", "content": "What is 12 + 30?" + QUESTION_SUFFIX}


def test_render_prompt_uses_chat_template_with_generation_prompt_and_no_thinking(recipe_tokenizer):
    tokens = render_prompt(recipe_tokenizer, "What is 12 + 30?")
    assert all(isinstance(t, int) for t in tokens)
    text = recipe_tokenizer.decode(tokens)
    assert text.startswith("<|im_start|>user\nHow many r's are in strawberry?")
    assert "<|im_start|>user\nWhat is 12 + 30?" + QUESTION_SUFFIX + "<|im_end|>\n" in text
    # add_generation_prompt=True opens the assistant turn; enable_thinking=False reached the template
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # special tokens are single ids, not spelled out byte by byte
    im_start = recipe_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokens.count(im_start) == 4


class VocabTokenizer(SimpleNamespace):
    def get_vocab(self):
        return self.vocab


def test_stop_sequences():
    assert stop_sequences(VocabTokenizer(eos_token="<|im_end|>", vocab={"<|im_end|>": 2})) == ["<|im_end|>"]
    assert stop_sequences(VocabTokenizer(eos_token="<|endoftext|>", vocab={"<|endoftext|>": 0, "<|im_end|>": 2})) == [
        "<|endoftext|>", "<|im_end|>"]
    assert stop_sequences(VocabTokenizer(eos_token="</s>", vocab={"</s>": 2})) == ["</s>"]
    assert stop_sequences(VocabTokenizer(eos_token=None, vocab={"<|im_end|>": 2})) == ["<|im_end|>"]


def test_stop_sequences_real_tokenizer(recipe_tokenizer):
    assert stop_sequences(recipe_tokenizer) == ["<|im_end|>"]


def test_arithmetic_fewshot_examples_are_correct_and_boxed():
    from recipes.grpo_lib import ARITHMETIC_FEWSHOT_PREFIX, FEWSHOT, grade

    assert FEWSHOT == {"gsm8k": FEWSHOT_PREFIX, "arithmetic": ARITHMETIC_FEWSHOT_PREFIX}
    turns = ARITHMETIC_FEWSHOT_PREFIX
    assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
    for user, assistant in zip(turns[::2], turns[1::2]):
        assert user["content"].endswith(QUESTION_SUFFIX)
        a, b = (int(x) for x in user["content"].removeprefix("What is ").split("?")[0].split(" + "))
        assert grade(assistant["content"], f"#### {a + b}") == 1.0


def test_render_prompt_with_another_fewshot(recipe_tokenizer):
    from recipes.grpo_lib import ARITHMETIC_FEWSHOT_PREFIX

    text = recipe_tokenizer.decode(render_prompt(recipe_tokenizer, "What is 11 + 22?", ARITHMETIC_FEWSHOT_PREFIX))
    assert "strawberry" not in text
    assert text.index("What is 23 + 45?") < text.index("What is 58 + 37?") < text.index("What is 11 + 22?")
