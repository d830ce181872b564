"""Puts ``tests/`` on ``sys.path`` for the suites in its subfolders (``tests/families/``),
which import the shared helpers and tables of ``tests/`` (``family_checks``,
``test_check_batch``) as the files at the top level do."""
