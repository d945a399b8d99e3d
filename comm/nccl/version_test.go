package nccl

import "testing"

func TestVersionCode(t *testing.T) {
	tests := []struct {
		major, minor, patch int
		code                int
		text                string
	}{
		{2, 8, 4, 2804, "2.8.4"}, // the old X*1000+Y*100+Z scheme
		{2, 7, 0, 2700, "2.7.0"},
		{2, 9, 6, 20906, "2.9.6"}, // X*10000+Y*100+Z from 2.9 on
		{2, 18, 1, 21801, "2.18.1"},
		{2, 21, 5, 22105, "2.21.5"},
		{2, 28, 3, 22803, "2.28.3"},
		{3, 0, 1, 30001, "3.0.1"},
	}
	for _, tc := range tests {
		t.Run(tc.text, func(t *testing.T) {
			code := VersionCode(tc.major, tc.minor, tc.patch)
			if code != tc.code {
				t.Errorf("VersionCode(%d, %d, %d) = %d, want %d", tc.major, tc.minor, tc.patch, code, tc.code)
			}
			if got := VersionString(code); got != tc.text {
				t.Errorf("VersionString(%d) = %q, want %q", code, got, tc.text)
			}
		})
	}
	if VersionCode(2, 14, 0) != MinVersion {
		t.Errorf("VersionCode(2, 14, 0) = %d, MinVersion %d", VersionCode(2, 14, 0), MinVersion)
	}
	if VersionCode(2, 18, 0) <= VersionCode(2, 8, 4) {
		t.Error("codes of the two schemes do not order 2.18 after 2.8")
	}
}
