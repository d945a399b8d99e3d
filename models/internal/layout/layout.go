// Package layout holds what the models share to explain a layout that does
// not fit their configuration.
package layout

import (
	"strconv"
	"strings"
)

// Divisors lists n's positive divisors in words, "1, 2 or 4", for messages
// that say which sizes of a mesh axis would work; it is "" for n < 1.
func Divisors(n int) string {
	var ds []string
	for d := 1; d <= n; d++ {
		if n%d == 0 {
			ds = append(ds, strconv.Itoa(d))
		}
	}
	switch len(ds) {
	case 0:
		return ""
	case 1:
		return ds[0]
	}
	return strings.Join(ds[:len(ds)-1], ", ") + " or " + ds[len(ds)-1]
}
