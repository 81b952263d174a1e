"""The package people `pip install`: a wheel built from the repo carries every exported module and the
runtime requirements of settings.ini, and imports from outside the source tree."""
import configparser, subprocess, sys, zipfile
from conftest import ROOT, run

def test_wheel_contents_and_metadata(tmp_path):
    run(sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', tmp_path, ROOT)
    wheel, = tmp_path.glob('ictd-*.whl')
    names = zipfile.ZipFile(wheel).namelist()
    modules = {p.name for p in (ROOT / 'ictd').glob('*.py')}
    assert modules <= {n.split('/')[-1] for n in names if n.startswith('ictd/')}, 'exported modules missing from the wheel'
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith('METADATA'))).decode()
    cfg = configparser.ConfigParser(delimiters=['=']); cfg.read(ROOT / 'settings.ini')
    for req in cfg['DEFAULT']['requirements'].split():
        name = req.split('>')[0].split('=')[0].split('<')[0]
        assert f'Requires-Dist: {name}' in meta, f'{name} missing from the wheel metadata'
    assert 'Provides-Extra: dev' in meta

def test_imports_outside_the_tree(tmp_path):
    "The installed package imports and works from an unrelated directory."
    code = 'import ictd, ictd.boyan as b; m = b.random_boyan_chain(seed=0); print(ictd.__version__, m.n_states)'
    out = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == '10'
