from server_mock.cli import entry

entry()
