package apiaccess

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// FuzzRead reads arbitrary bytes as the API access file, as the plugin's
// agent-down check does. Properties: no panic; whatever Read accepts is
// usable (Validate passes) and round trips through Write and Read
// unchanged, and writing it again changes nothing on disk.
func FuzzRead(f *testing.F) {
	for _, seed := range []string{
		`{"server":"https://10.96.0.1:443","caData":"LS0tLS1CRUdJTg==","token":"eyJhbGciOiJSUzI1NiJ9.e30.sig","expires":"2026-12-01T18:00:00Z","enrollmentLabel":"istio.io/dataplane-mode"}`,
		`{"server":"https://[fd00::1]:6443","token":"t"}`,
		`{"server":"http://10.96.0.1","token":"t"}`,
		`{"server":"https://","token":"t"}`,
		`{"server":"https://h","token":""}`,
		`{"server":"https://h","token":"t","expires":"2026-12-01T18:00:00+23:59"}`,
		`{"server":"https://h","token":"t","expires":"0001-01-01T00:00:00Z","caData":null}`,
		`{"server":"https://h","token":"t","caData":"not base64"}`,
		`{"server":"https://h","token":"t","unknown":{"deep":[1,2,3]}}`,
		`null`, `[]`, ``,
	} {
		f.Add([]byte(seed))
	}
	dir := f.TempDir()
	in, out := filepath.Join(dir, "in"), filepath.Join(dir, "out")
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(in, data, 0o600); err != nil {
			t.Fatal(err)
		}
		a, err := Read(in)
		if err != nil {
			if a != nil {
				t.Fatalf("Read returned access with error %v", err)
			}
			return
		}
		if err := a.Validate(); err != nil {
			t.Fatalf("Read accepted an unusable file: %v", err)
		}
		os.Remove(out)
		if _, err := Write(out, a); err != nil {
			t.Fatalf("Write of what Read accepted: %v", err)
		}
		b, err := Read(out)
		if err != nil {
			t.Fatalf("Read of what Write wrote: %v", err)
		}
		if !b.Expires.Equal(a.Expires) {
			t.Fatalf("expiry %v read back as %v", a.Expires, b.Expires)
		}
		// The same access, whether its CA is absent or empty; compared on
		// copies, so the file b came from is what Write sees again below.
		same := func(x Access) Access {
			x.Expires = b.Expires
			if len(x.CAData) == 0 {
				x.CAData = nil
			}
			return x
		}
		if !reflect.DeepEqual(same(*a), same(*b)) {
			t.Fatalf("round trip changed the access:\n%+v\n%+v", a, b)
		}
		if changed, err := Write(out, b); err != nil || changed {
			t.Fatalf("writing the same access again: changed %v, %v", changed, err)
		}
	})
}
