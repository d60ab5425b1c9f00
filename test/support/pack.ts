/**
 * The tarball users get: `npm pack` in a fresh clone of the repository at HEAD (no dist/, none of
 * the working tree's edits), as `npm publish` would run it. Packed once per commit and shared by the
 * tests that install it. The clone builds with this tree's node_modules, hard-linked (a symlink
 * makes TypeScript name types by paths outside the package), so it lives beside them, in .edgepg/.
 */
import { execFile } from 'node:child_process'
import { existsSync, mkdirSync, mkdtempSync, readdirSync, renameSync, rmSync } from 'node:fs'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'

const run = promisify(execFile)
const root = fileURLToPath(new URL('../..', import.meta.url))

/** The packed tarball's absolute path. */
export async function packedTarball(): Promise<string> {
  const commit = (await run('git', ['rev-parse', 'HEAD'], { cwd: root })).stdout.trim()
  const home = join(root, '.edgepg')
  const done = join(home, `pack-${commit}`)
  const tarball = join(done, 'edgepg.tgz')
  if (existsSync(tarball)) return tarball
  mkdirSync(home, { recursive: true })
  // Other commits' tarballs go (not this one's: another test file may be packing it at once, or installing it).
  for (const old of readdirSync(home)) if (old.startsWith('pack-') && old !== `pack-${commit}`) rmSync(join(home, old), { recursive: true, force: true })
  const work = mkdtempSync(join(home, 'packing-'))
  const clone = join(work, 'clone')
  await run('git', ['clone', '--quiet', '--depth', '1', `file://${root}`, clone])
  await run('cp', ['-al', join(root, 'node_modules'), join(clone, 'node_modules')])
  const { stdout } = await run('npm', ['pack', '--silent', '--pack-destination', work], { cwd: clone, timeout: 180_000 })
  renameSync(join(work, stdout.trim().split('\n').pop()!), join(work, 'edgepg.tgz'))
  rmSync(clone, { recursive: true, force: true })
  try {
    renameSync(work, done)
  } catch {
    rmSync(work, { recursive: true, force: true }) // another test packed the same commit first
  }
  return tarball
}
