from server_mock.cli import main

main()
