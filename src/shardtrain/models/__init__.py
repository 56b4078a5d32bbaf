"""The project's own small models and data, made here (nothing is downloaded): a GPT (:mod:`.gpt`) and a Markov
chain corpus (:mod:`.markov`) for the demo, the examples, the benchmarks and the tests."""
