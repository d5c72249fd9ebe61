"""A few KB of plain English the example models' byte-level BPE tokenizer is trained on."""

CORPUS = """\
An inference server stands between the people who ask questions and the models that answer them.
Every request wants its answer soon, and every machine wants to stay busy. A request that runs
alone is answered quickly, but the hardware waits for the next one. Requests that run together
keep the hardware busy, but each one waits for the others. That is the balance between latency
and throughput, and a good server makes it explicit, measures it and holds it while load changes.

For a language model the balance is decided one token at a time. A sequence that has finished can
leave the batch at once, and a new one can join at the very next step. The scheduler gives every
step a budget of tokens. Running sequences take one token each for their next word, and the rest
of the budget goes to the prompts of waiting sequences, cut into chunks so that a long prompt never
stalls the others. A small budget keeps every step short, which favours the time to the first
token and the time between tokens. A large budget fills the machine, which favours throughput.

The keys and values of the attention layers are kept in a pool of fixed-size blocks. Each sequence
owns a table of block numbers, so its memory need not be contiguous and nothing is reserved for
tokens it may never write. When the pool runs out, the newest sequence of the lowest priority is
preempted: its blocks are freed and it is computed again later, from the start, in order. When
two prompts share a beginning, such as the same system prompt, the blocks of that beginning are
found by a chained hash of their tokens and reused, and only the rest of the prompt is computed.
The stored tokens are compared on every hit, so a collision of hashes can never change an answer.

The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly. Pack my box
with five dozen liquor jugs. How vexingly quick daft zebras jump. Sphinx of black quartz, judge my
vow. Numbers help too: one, two, three, four, five, six, seven, eight, nine, ten, 0123456789.

Hello! How are you today? I am fine, thank you. What would you like to know? Tell me a story about
a small robot that learned to count the stars, one by one, until the morning came. Once upon a
time there was a little server that answered every question it was asked, politely and on time.
It measured everything it did, kept its queues short, and said no quickly when it was too busy,
so that the people who waited were never left waiting for nothing. The end.
"""
