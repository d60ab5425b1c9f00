/**
 * The code blocks of the README, CONTRIBUTING.md and docs/: what test/doc-blocks.test.ts runs, and
 * what other tests take from the page they are shown on (so a block and what runs cannot differ).
 */
import { readdirSync, readFileSync } from 'node:fs'
import { fileURLToPath } from 'node:url'

const root = fileURLToPath(new URL('../..', import.meta.url))

export interface DocBlock {
  /** The page, from the repository's root: `docs/driver.md`. */
  page: string
  /** The line of its opening fence. */
  line: number
  lang: string
  code: string
}

export const DOC_PAGES = ['README.md', 'CONTRIBUTING.md', ...readdirSync(`${root}docs`).filter((f) => f.endsWith('.md')).map((f) => `docs/${f}`)]

export function docBlocks(pages = DOC_PAGES): DocBlock[] {
  return pages.flatMap((page) => {
    const lines = readFileSync(`${root}${page}`, 'utf8').split('\n')
    const found: DocBlock[] = []
    for (let i = 0; i < lines.length; i++) {
      const open = /^```(\S*)/.exec(lines[i])
      if (!open) continue
      const end = lines.findIndex((l, j) => j > i && l.startsWith('```'))
      if (end < 0) throw new Error(`${page}:${i + 1}: a code block that never closes`)
      found.push({ page, line: i + 1, lang: open[1], code: lines.slice(i + 1, end).join('\n') + '\n' })
      i = end
    }
    return found
  })
}

/** The one block of `page` whose text contains `marker`. */
export function docBlock(page: string, marker: string): DocBlock {
  const found = docBlocks([page]).filter((b) => b.code.includes(marker))
  if (found.length !== 1) throw new Error(`${page}: ${found.length} code blocks contain ${JSON.stringify(marker)}, expected one`)
  return found[0]
}
