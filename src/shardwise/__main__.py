from shardwise.cli.main import main

raise SystemExit(main())
