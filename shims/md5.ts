// md5 alone (its module also holds sha1 and ripemd160), for the crypto shim to load lazily.
export { md5 } from '@noble/hashes/legacy.js'
