"""The language model: a decoder (``model.kind``: the GPT, the Llama, a registered one) on
the characters of a text, in any dp x tp x pp layout with
ZeRO and mixed precision (the default application of ``shardwise train``).

- ``text``: the character tokenizer, the training / validation split, the corpus check at
  the door.
- ``model``: the ``[model]`` section as a ``GPTConfig`` (the parameter server's), the
  words for a layout (the trainer reads any kind through ``models.describe_section``).
- ``trainer``: ``Trainer`` (one rank's step, evaluation, samples) driven by
  ``training.loop.run_loop``; ``state``: its checkpoint state.
- ``app``: ``train_rank``, each rank's entry point under the CLI.
"""
