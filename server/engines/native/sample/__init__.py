"""From a step's logits to tokens and text: sampling, logits processors, logprobs, the grammar's
token masks, the rows of a request and incremental detokenisation."""
