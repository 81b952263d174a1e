"""The package people `pip install` and the files a paper's companion needs: a wheel built from the repo carries
every exported module and the runtime requirements of settings.ini, and imports from outside the source tree; its
metadata is honest (no placeholder address, no home page that does not exist, a license classifier, the
development status settings.ini gives, a torch floor that the Makefile tests); CITATION.cff cites the book and
the paper; the repository holds no output of the `ictd` command."""
import configparser, re, shutil, subprocess, sys, zipfile
import pytest
import yaml
from conftest import ROOT, run

CFG = configparser.ConfigParser(delimiters=['='])
CFG.read(ROOT / 'settings.ini')
SETTINGS = CFG['DEFAULT']


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
    "The names in the wheel built from the repo, and its METADATA."
    out = tmp_path_factory.mktemp('wheel')
    run(sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', out, ROOT)
    w, = out.glob('ictd-*.whl')
    names = zipfile.ZipFile(w).namelist()
    return names, zipfile.ZipFile(w).read(next(n for n in names if n.endswith('METADATA'))).decode()


def test_wheel_contents_and_metadata(wheel):
    names, meta = wheel
    modules = {p.name for p in (ROOT / 'ictd').glob('*.py')}
    assert modules <= {n.split('/')[-1] for n in names if n.startswith('ictd/')}, 'exported modules missing from the wheel'
    for req in SETTINGS['requirements'].split():
        name = req.split('>')[0].split('=')[0].split('<')[0]
        assert f'Requires-Dist: {name}' in meta, f'{name} missing from the wheel metadata'
    assert 'Provides-Extra: dev' in meta


@pytest.mark.book
def test_metadata_is_honest(wheel):
    "No placeholder, no link to a repository settings.ini does not call public, the license and status settings.ini gives."
    _, meta = wheel
    assert 'example.org' not in meta and 'example.com' not in meta
    links = re.findall(r'^(?:Home-page|Project-URL|Download-URL): .*$', meta, re.M)
    if not CFG.getboolean('DEFAULT', 'repo_public', fallback=False): assert not links, links
    assert 'Classifier: License :: OSI Approved :: Apache Software License' in meta and SETTINGS['license'] == 'apache2'
    status = int(SETTINGS['status'])
    assert re.findall(r'^Classifier: Development Status :: (\d) - ', meta, re.M) == [str(status)]
    assert re.search(r'^Author: \S', meta, re.M)


@pytest.mark.book
def test_torch_floor_is_the_tested_version():
    "The torch floor of settings.ini is the release `make setup` installs and tests (and the one installed here satisfies it)."
    import torch
    floor, = re.findall(r'\btorch>=([\d.]+)', SETTINGS['requirements'])
    installed, = re.findall(r'pip install -q torch==([\d.]+)', (ROOT / 'Makefile').read_text())
    as_tuple = lambda v: tuple(int(x) for x in re.match(r'[\d.]+', v).group().rstrip('.').split('.'))
    assert as_tuple(floor) == as_tuple(installed)[:len(as_tuple(floor))], f'settings.ini says torch>={floor}, the Makefile tests {installed}'
    assert as_tuple(torch.__version__)[:3] >= as_tuple(floor)


@pytest.mark.book
def test_citation_file():
    "CITATION.cff: CFF 1.2.0 with its required keys, the package's version and license, and the paper (arXiv 2605.07333) as a reference."
    cff = yaml.safe_load((ROOT / 'CITATION.cff').read_text())
    assert cff['cff-version'] == '1.2.0' and {'authors', 'message', 'title'} <= set(cff)
    assert str(cff['version']) == SETTINGS['version'] and cff['license'] == {'apache2': 'Apache-2.0'}[SETTINGS['license']]
    paper, = [r for r in cff['references'] if 'Softmax Transformers Implement In-Context Reinforcement Learning' in r['title']]
    assert paper['url'] == 'https://arxiv.org/abs/2605.07333' and {'type', 'authors', 'title'} <= set(paper)
    assert any(i['value'] == 'arXiv:2605.07333' for i in paper['identifiers'])
    for ref in [cff] + cff['references']:  # CFF lists of authors have unique items, each a person or an entity with a name
        authors = ref['authors']
        assert len(authors) == len({yaml.safe_dump(a) for a in authors}) and all(a.get('name') or a.get('family-names') for a in authors)


@pytest.mark.book
def test_no_cli_output_in_the_repository():
    "No tracked file lies in an `ictd` output folder, and git ignores those folders."
    if not shutil.which('git') or not (ROOT / '.git').exists(): pytest.skip('not a git checkout')
    tracked = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in tracked if re.search(r'(^|/)(ictd-results|results)/', f)]
    probe = subprocess.run(['git', 'check-ignore', 'nbs/ictd-results/linear.pt', 'ictd-results/x.json', 'results/x.png'], cwd=ROOT, capture_output=True, text=True)
    assert len(probe.stdout.split()) == 3, probe.stdout


def test_imports_outside_the_tree(tmp_path):
    "The installed package imports and works from an unrelated directory."
    code = 'import ictd, ictd.boyan as b; m = b.random_boyan_chain(seed=0); print(ictd.__version__, m.n_states)'
    out = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == '10'
