"""Selection: rules that turn score columns into one ranking, ``select`` (restrictions, top-k, the output) and
its summary."""
