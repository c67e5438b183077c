from torchloom.cli import main

raise SystemExit(main())
