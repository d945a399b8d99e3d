//go:build !unix

package checkpoint

import "os"

// flock is a no-op where flock(2) does not exist: the folder is not
// locked there.
func flock(*os.File) error { return nil }
