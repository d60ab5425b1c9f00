// There is no ~/.pgpass outside Node: report "no password found", as pgpass does.
module.exports = function pgpass(_params, cb) {
  cb(undefined)
}
