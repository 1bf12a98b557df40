package main

const sysSetns = 268 // setns(2) on arm64 (not in Go 1.19's syscall package)
