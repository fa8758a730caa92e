module kvsieve.example/go

go 1.19
