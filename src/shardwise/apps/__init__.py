"""What can be trained (``registry``: one ``AppSpec`` each): the language model (``lm``), the
CNN with a per-layer plan (``cnn``), the parameter server (``param_server``)."""
