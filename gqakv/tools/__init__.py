"""The ``gqakv`` command (``cli``) and its subcommands: ``bench``, ``info``, ``size``,
``selftest``. The top layer: nothing else in gqakv imports it; only here may a module
import a backend plugin's own modules (the self-test and the benchmark reach into them)."""
