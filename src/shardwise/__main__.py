from shardwise.cli import main

raise SystemExit(main())
