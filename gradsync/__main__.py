"""python -m gradsync -> gradsync.cli.main()"""

from .cli import main

raise SystemExit(main())
