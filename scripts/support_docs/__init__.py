"""What ``docs/support.md`` says about torch releases, generated (``scripts/support_table.py``).

- :mod:`.scan`: every private torch API ``dynamo_ext/`` uses, found by reading its source (``ast``);
- :mod:`.presence`: whether each of them exists in a torch release (run under that release's interpreter);
- :mod:`.runs`: a recorded run of the suite and the corpus on a release (``scripts/other_torch.sh``);
- :mod:`.render`: the tables, written between generated-region comments of ``docs/support.md``, and the list
  of private APIs ``dynamo_ext/_compat/releases/private_apis.py`` checks at ``install()``.

Standard library only: ``scripts/other_torch.sh`` runs it with the interpreter of the release it tests.
"""
